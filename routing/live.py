"""This process's live routing state: its snapshot, its router, its load stats.

One of each per serving process. The proxy and the explain API read them; only
the holder's background tasks replace the snapshot.
"""

from __future__ import annotations

from django.conf import settings

from routing.core import LiveStats, Router, RouterSnapshot
from routing.holder import SnapshotHolder
from routing.snapshot import build_snapshot

snapshots: SnapshotHolder[RouterSnapshot] = SnapshotHolder(
    build_snapshot, poll_interval=settings.NEXUS_CONFIG_POLL_INTERVAL
)
router = Router()
stats = LiveStats()
