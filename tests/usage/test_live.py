"""Live counters per time slot: what the dashboard's five-minute chart reads."""

from __future__ import annotations

from tests.factories import UsageEventFactory
from usage.live import RECENT_SECONDS, SLOT_SECONDS, AdmissionLiveDict, LiveUsage
from usage.publisher import merge_snapshots


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_finished_requests_are_counted_per_slot() -> None:
    clock = Clock(1_000_003.0)
    live = LiveUsage(clock=clock, process="p1")

    live.record(UsageEventFactory(total_tokens=15))
    clock.now += 4  # same slot
    live.record(UsageEventFactory(status=502, total_tokens=0))
    clock.now += SLOT_SECONDS
    live.record(UsageEventFactory(total_tokens=7))

    assert live.snapshot()["recent"] == [
        {"start": 1_000_000, "requests": 2, "errors": 1, "total_tokens": 15},
        {"start": 1_000_010, "requests": 1, "errors": 0, "total_tokens": 7},
    ]


def test_old_slots_are_forgotten_so_memory_stays_bounded() -> None:
    clock = Clock(2_000_000.0)
    live = LiveUsage(clock=clock)
    for _ in range(200):  # over half an hour of traffic, a request a slot
        live.record(UsageEventFactory())
        clock.now += SLOT_SECONDS

    recent = live.snapshot()["recent"]

    assert len(recent) <= RECENT_SECONDS // SLOT_SECONDS
    assert recent[0]["start"] > clock.now - RECENT_SECONDS


def test_processes_slots_are_summed_when_merged() -> None:
    clock = Clock(3_000_000.0)
    first, second = (
        LiveUsage(clock=clock, process="a"),
        LiveUsage(clock=clock, process="b"),
    )
    first.record(UsageEventFactory(total_tokens=3))
    second.record(UsageEventFactory(total_tokens=4))
    second.record(UsageEventFactory(total_tokens=5))
    older = first.snapshot() | {"recent": []}  # a peer of an older version: none
    del older["recent"]

    merged = merge_snapshots(
        [first.snapshot(), second.snapshot(), older | {"process": "c"}],  # type: ignore[list-item]
        taken_at=clock.now,
    )

    assert merged["slot_seconds"] == SLOT_SECONDS
    assert merged["recent"] == [
        {"start": 3_000_000, "requests": 3, "errors": 0, "total_tokens": 12}
    ]


def _admission(stock: int, flows: dict[str, int], **counts: int) -> AdmissionLiveDict:
    return {
        "enabled": True,
        "pools": [
            {
                "pool": "m",
                "backends": ["gpu-1", "gpu-2"],
                "models": ["m"],
                "unit": "requests",
                "stock": stock,
                "waiting": sum(flows.values()),
                "lower": 7.2,
                "upper": 8.8,
                "watermark": 8.0,
                "dispatch_limit": 4,
                "bypass_limit": 5 - (stock % 2),
                "flows": flows,
            }
        ],
        "rejections": {"queue_full": counts.get("full", 0)},
        "preemptions": {"sheddable": counts.get("shed", 0)},
        "bypassed": 10,
        "dispatched": 2,
        "changes": 12,
    }


def test_admission_of_every_process_adds_up_per_pool() -> None:
    # Two processes, each with its share of the same pool's band.
    first = LiveUsage(process="a", admission=lambda: _admission(4, {"k1": 3}, full=1))
    second = LiveUsage(
        process="b", admission=lambda: _admission(3, {"k1": 1, "k2": 2}, shed=2)
    )
    first_snapshot = first.snapshot()
    older = first_snapshot | {"process": "c"}  # a peer of an older version: none
    del older["admission"]

    admission = merge_snapshots(
        [first_snapshot, second.snapshot(), older], taken_at=0.0
    )["admission"]

    assert admission is not None
    (pool,) = admission["pools"]
    assert (pool["stock"], pool["waiting"]) == (7, 6)
    assert (pool["dispatch_limit"], pool["bypass_limit"]) == (8, 9)
    assert (pool["lower"], pool["upper"]) == (7.2, 8.8)  # the gateway's already
    assert pool["flows"] == {"k1": 4, "k2": 2}
    assert admission["rejections"] == {"queue_full": 1}
    assert admission["preemptions"] == {"sheddable": 2}
    assert admission["bypassed"] == 20
    assert merge_snapshots([LiveUsage().snapshot()], taken_at=0.0)["admission"] is None
