"""This process's live gateway state: what it routes with, and its load stats.

One of each per serving process. The proxy and the explain API read them; only
the holder's background tasks replace the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from django.conf import settings
from django.db import transaction

from routing.core import LiveStats, Router, RouterSnapshot
from routing.holder import SnapshotHolder
from routing.snapshot import build_snapshot
from usage.models import ApiKey


@dataclass(frozen=True, slots=True)
class GatewayState:
    """Everything the proxy reads, frozen at one configuration version."""

    version: int
    routes: RouterSnapshot
    # SHA-256 hex of every active client key -> its visible prefix.
    keys: Mapping[str, str]


def build_state() -> GatewayState:
    """Read the routing tables and the active client keys (sync code only)."""
    with transaction.atomic():
        routes = build_snapshot()
        keys = dict(ApiKey.objects.active().values_list("hashed_key", "prefix"))
    return GatewayState(
        version=routes.version, routes=routes, keys=MappingProxyType(keys)
    )


snapshots: SnapshotHolder[GatewayState] = SnapshotHolder(
    build_state, poll_interval=settings.NEXUS_CONFIG_POLL_INTERVAL
)
router = Router()
stats = LiveStats()
