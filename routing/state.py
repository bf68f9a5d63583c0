"""What a serving process routes with: the gateway state, built from the database.

The gateway's snapshot holder calls ``build_state()`` off the request path and
swaps the result in whole; the proxy only ever reads a ``GatewayState``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from django.db import transaction

from routing.core import RouterSnapshot
from routing.snapshot import build_snapshot
from usage.models import ApiKey


@dataclass(frozen=True, slots=True)
class GatewayState:
    """Everything the proxy reads, frozen at one configuration version."""

    version: int
    routes: RouterSnapshot
    # SHA-256 hex of every active client key -> its visible prefix.
    keys: Mapping[str, str]

    @property
    def expires_at(self) -> float | None:
        """When a backend's health result goes stale (rebuild then); see routes."""
        return self.routes.expires_at


def build_state() -> GatewayState:
    """Read the routing tables and the active client keys (sync code only)."""
    with transaction.atomic():
        routes = build_snapshot()
        keys = dict(ApiKey.objects.active().values_list("hashed_key", "prefix"))
    return GatewayState(
        version=routes.version, routes=routes, keys=MappingProxyType(keys)
    )
