"""Words the backends app shares with the router core: pure Python, no Django.

``HealthStatus`` is the one list of health states. ``backends.models`` stores
them (``Backend.status``) and the health checker moves between them;
``routing.core`` reads them (as ``Health``) to decide whether a backend may
take requests. The router core imports no Django, so this module imports
nothing but the standard library (an import-linter contract keeps it so).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

# A keep_alive expiry moving forward by less than this is stored without
# announcing a change (it moves with every request to a busy model).
EXPIRY_SLACK = timedelta(seconds=60)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """What a backend says about one model in its memory (None: it did not say)."""

    vram_bytes: int | None = None
    context_length: int | None = None
    expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class WorkerState:
    """What a worker's local backend reported, as the database keeps it.

    ``loaded`` None: the backend does not say (left as recorded). ``memory_gb``
    (the worker's --memory-gb) becomes the memory the relay backend reports
    (``memory_total_bytes``, beside what its loaded models take: the learned
    capacity a health round fills for a direct backend; an operator's
    ``memory_ceiling_gb`` still overrides it), ``max_concurrency`` (its max
    concurrency within the backend's slots) its max concurrency and its
    reported slots; None leaves either as it is.
    """

    loaded: frozenset[str] | None = None
    details: Mapping[str, LoadedModel] = field(default_factory=dict)
    memory_gb: float | None = None
    max_concurrency: int | None = None


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
