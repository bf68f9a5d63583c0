"""Words the backends app shares with the router core: pure Python, no Django.

``HealthStatus`` is the one list of health states. ``backends.models`` stores
them (``Backend.status``) and the health checker moves between them;
``routing.core`` reads them (as ``Health``) to decide whether a backend may
take requests. The router core imports no Django, so this module imports
nothing but the standard library (an import-linter contract keeps it so).
"""

from __future__ import annotations

import enum


class HealthStatus(enum.StrEnum):
    """A backend's health as the health checker last recorded it."""

    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    # Set by an operator: no new requests, requests in flight finish.
    DRAINING = "draining"

    @property
    def label(self) -> str:
        """The state for people ("Healthy")."""
        return self.value.capitalize()
