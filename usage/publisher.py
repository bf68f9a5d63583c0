"""Share live usage counters between serving processes, and merge them.

Every serving process's gateway runs one ``UsagePublisher``. About twice a
second it sends the process's ``LiveUsage.snapshot()`` to the ``nexus.usage``
Channels group when the counters moved (and every few seconds anyway, so that
a process that just started learns of idle peers). The gateway listens on that
group and hands each message to ``on_message()``, which keeps the newest
snapshot of every process it hears of and wakes this process's usage streams.
The process joins the group once, rather than once per open browser tab, so
the merge happens once however many dashboards are open.

Production (Redis channel layer): every process hears every other, so each
stream shows the whole cluster. Embedded mode (in-memory channel layer): the
layer does not cross process boundaries, so a stream shows only the counters
of the process serving it.

Subscribers never block the producer: each holds one "something changed" flag,
not a queue of snapshots, and reads the newest merged state when it is ready
to send. A slow reader therefore skips intermediate states instead of piling
them up here. (What the server already handed to the socket is out of reach:
Daphne buffers it for a client that stopped reading, which the stream's rate
limit keeps to a few small events a second.)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, TypedDict

from channels.layers import get_channel_layer

from nexus_lib.service import periodic
from usage.live import (
    SLOT_SECONDS,
    AdmissionLiveDict,
    AdmissionPoolDict,
    LiveSnapshotDict,
    LiveUsage,
    SeriesDict,
    SlotDict,
)

logger = logging.getLogger(__name__)

USAGE_GROUP = "nexus.usage"
PUBLISH_INTERVAL = 0.5  # seconds between checks of this process's counters
HEARTBEAT_SECONDS = 5.0  # publish at least this often, even when idle
# A process not heard of for this long has stopped; its counters are dropped.
STALE_AFTER_SECONDS = 20.0


class UsageSnapshotMessage(TypedDict):
    """The channel-layer message: one process's counters."""

    type: str  # always "usage.snapshot"
    snapshot: LiveSnapshotDict


class ModelLatencyDict(TypedDict):
    model: str
    p50_ms: float | None
    p95_ms: float | None
    samples: int


class ClusterUsageDict(TypedDict):
    """The counters of every known process, summed per backend × model."""

    taken_at: float
    processes: list[str]
    series: list[SeriesDict]
    latency: list[ModelLatencyDict]
    slot_seconds: int
    recent: list[SlotDict]  # summed per slot, oldest first
    admission: AdmissionLiveDict | None  # summed over the processes


class Subscription:
    """One reader of the merged state: a flag that says "something changed"."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()

    async def wait(self) -> None:
        """Wait until the state changed since the last wait() returned."""
        await self._changed.wait()
        self._changed.clear()


class UsagePublisher:
    """Publishes this process's counters and collects those of its peers.

    A service (nexus_lib.service): publishing runs from ``start()`` to
    ``stop()``; peers' counters come in through ``on_message()``.
    """

    name = "publisher"

    def __init__(
        self, live_usage: LiveUsage, interval: float = PUBLISH_INTERVAL
    ) -> None:
        self.live_usage = live_usage
        self.interval = interval
        self._known: dict[str, LiveSnapshotDict] = {}
        self._subscriptions: set[Subscription] = set()
        self._last_changes = -1
        self._last_sent = 0.0
        self._publishing = periodic(
            "usage-publish",
            lambda: self.interval,
            self._publish,
            error="Could not publish live usage",
            log=logger.warning,
        )

    @property
    def subscriber_count(self) -> int:
        """How many usage streams this process is serving right now."""
        return len(self._subscriptions)

    def start(self) -> None:
        """Start publishing this process's counters on the running loop."""
        self._last_changes, self._last_sent = -1, 0.0
        self._publishing.start()

    async def stop(self) -> None:
        """Stop publishing."""
        await self._publishing.stop()

    def subscribe(self) -> Subscription:
        """Register a reader; it is woken whenever the merged state changes."""
        subscription = Subscription()
        self._subscriptions.add(subscription)
        self._notify_all()  # the subscriber count is part of the state
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        if subscription in self._subscriptions:
            self._subscriptions.discard(subscription)
            self._notify_all()

    def _notify_all(self) -> None:
        for subscription in self._subscriptions:
            subscription.notify()

    def remember(self, snapshot: LiveSnapshotDict) -> None:
        """Keep `snapshot` if it is the newest of its process; wake the readers."""
        known = self._known.get(snapshot["process"])
        if known is not None and known["taken_at"] > snapshot["taken_at"]:
            return
        self._known[snapshot["process"]] = snapshot
        self._notify_all()

    def cluster_state(self) -> ClusterUsageDict:
        """Merge the newest counters of every live process (this one is current)."""
        now = time.time()
        own = self.live_usage.snapshot()
        # Forget stopped processes, so restarts do not pile up old names.
        for process, snapshot in list(self._known.items()):
            if now - snapshot["taken_at"] >= STALE_AFTER_SECONDS:
                del self._known[process]
        snapshots = [own] + [
            snapshot
            for process, snapshot in self._known.items()
            if process != own["process"]
        ]
        return merge_snapshots(snapshots, taken_at=now)

    async def _publish(self) -> None:
        """Send this process's counters if they moved or a heartbeat is due."""
        now = time.monotonic()
        if (
            self.live_usage.version() == self._last_changes
            and now - self._last_sent < HEARTBEAT_SECONDS
        ):
            return
        snapshot = self.live_usage.snapshot()
        self._last_changes, self._last_sent = snapshot["changes"], now
        self.remember(snapshot)
        layer = get_channel_layer()
        if layer is None:
            return
        message: UsageSnapshotMessage = {
            "type": "usage.snapshot",
            "snapshot": snapshot,
        }
        await layer.group_send(USAGE_GROUP, message)

    def on_message(self, message: dict[str, Any]) -> None:
        """Handle a message of USAGE_GROUP (a process's counters)."""
        if message.get("type") == "usage.snapshot":
            self.remember(message["snapshot"])


def merge_snapshots(
    snapshots: list[LiveSnapshotDict], *, taken_at: float
) -> ClusterUsageDict:
    """Sum the series of `snapshots` per backend × model; pool their latencies."""
    series: dict[tuple[str, str], SeriesDict] = {}
    latencies: dict[str, list[float]] = {}
    recent: dict[int, SlotDict] = {}
    for snapshot in snapshots:
        # .get(): a process of an older version sends no slots.
        for slot in snapshot.get("recent", []):
            summed = recent.get(slot["start"])
            if summed is None:
                recent[slot["start"]] = SlotDict(**slot)
                continue
            summed["requests"] += slot["requests"]
            summed["errors"] += slot["errors"]
            summed["total_tokens"] += slot["total_tokens"]
        for row in snapshot["series"]:
            key = (row["backend"], row["model"])
            merged = series.get(key)
            if merged is None:
                series[key] = SeriesDict(**row)
                continue
            merged["requests"] += row["requests"]
            merged["errors"] += row["errors"]
            merged["prompt_tokens"] += row["prompt_tokens"]
            merged["completion_tokens"] += row["completion_tokens"]
            merged["total_tokens"] += row["total_tokens"]
            merged["in_flight"] += row["in_flight"]
        for model, values in snapshot["latencies_ms"].items():
            latencies.setdefault(model, []).extend(values)
    admission = merge_admission(
        [state for s in snapshots if (state := s.get("admission")) is not None]
    )
    return {
        "taken_at": taken_at,
        "processes": sorted(snapshot["process"] for snapshot in snapshots),
        "series": [series[key] for key in sorted(series)],
        "latency": [
            {
                "model": model,
                "p50_ms": _percentile(values, 50),
                "p95_ms": _percentile(values, 95),
                "samples": len(values),
            }
            for model, values in sorted(latencies.items())
        ],
        "slot_seconds": SLOT_SECONDS,
        "recent": [recent[start] for start in sorted(recent)],
        "admission": admission,
    }


def merge_admission(states: list[AdmissionLiveDict]) -> AdmissionLiveDict | None:
    """The gateway's admission control from its processes' (None: no process).

    A pool (one served model) in several processes: stocks, queues and the
    processes' shares of the band add up; the band's bounds are the
    gateway's already.
    """
    if not states:
        return None
    pools: dict[tuple[str, ...], AdmissionPoolDict] = {}
    rejections: dict[str, int] = {}
    preemptions: dict[str, int] = {}
    for state in states:
        for pool in state["pools"]:
            # A process of an older version says only its backends.
            served = pool.get("pool")
            key = (served,) if isinstance(served, str) else tuple(pool["backends"])
            merged = pools.get(key)
            if merged is None:
                pools[key] = {**pool, "flows": dict(pool["flows"])}
                continue
            for name in ("stock", "waiting", "dispatch_limit", "bypass_limit"):
                merged[name] += pool[name]
            merged["models"] = sorted({*merged["models"], *pool["models"]})
            merged["backends"] = sorted({*merged["backends"], *pool["backends"]})
            for flow, waiting in pool["flows"].items():
                merged["flows"][flow] = merged["flows"].get(flow, 0) + waiting
        _add_counts(rejections, state["rejections"])
        _add_counts(preemptions, state["preemptions"])
    return {
        "enabled": any(state["enabled"] for state in states),
        "pools": [pools[key] for key in sorted(pools)],
        "rejections": rejections,
        "preemptions": preemptions,
        "bypassed": sum(state["bypassed"] for state in states),
        "dispatched": sum(state["dispatched"] for state in states),
        "changes": sum(state["changes"] for state in states),
    }


def _add_counts(into: dict[str, int], counts: dict[str, int]) -> None:
    for name, count in counts.items():
        into[name] = into.get(name, 0) + count


def _percentile(values: list[float], percent: float) -> float | None:
    # Nearest rank: always one of the observed values, no interpolation.
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return round(ordered[rank - 1], 1)
