"""Live per-backend load and latency (routing/core/stats.py)."""

from __future__ import annotations

import threading

import pytest

from routing.core import (
    BackendSpec,
    LiveStats,
    ModelSpec,
    RequestRequirements,
    Router,
    RouterSnapshot,
)

pytestmark = pytest.mark.mode_independent


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def backend(name: str, **fields: object) -> BackendSpec:
    return BackendSpec(
        name=name,
        base_url="http://h",
        status="healthy",
        models=(ModelSpec("m"),),
        **fields,  # type: ignore[arg-type]
    )


def test_in_flight_counts_go_up_and_down() -> None:
    stats = LiveStats()
    stats.begin("a")
    stats.begin("a")
    stats.end("a")
    assert stats.in_flight("a") == 1
    assert stats.in_flight("never-seen") == 0


def test_in_flight_never_goes_below_zero() -> None:
    stats = LiveStats()
    stats.end("a")
    stats.end("a")
    stats.begin("a")
    assert stats.in_flight("a") == 1


def test_try_begin_stops_at_max_concurrency() -> None:
    stats = LiveStats()
    limited = backend("a", max_concurrency=2)
    assert [stats.try_begin(limited) for _ in range(3)] == [True, True, False]
    stats.end("a")
    assert stats.try_begin(limited) is True


def test_try_begin_without_a_limit_always_admits() -> None:
    stats = LiveStats()
    assert all(stats.try_begin(backend("a")) for _ in range(500))
    assert stats.in_flight("a") == 500


def test_threads_counting_at_once_lose_no_updates() -> None:
    stats = LiveStats()

    def work() -> None:
        for _ in range(5000):
            stats.begin("a")
            stats.end("a")
            stats.begin("a")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stats.in_flight("a") == 8 * 5000


def test_first_latency_observation_is_taken_as_is_then_smoothed() -> None:
    stats = LiveStats(alpha=0.5)
    stats.observe_latency("a", 100.0)
    assert stats.latency_ms("a") == 100.0
    stats.observe_latency("a", 200.0)
    assert stats.latency_ms("a") == 150.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5.0])
def test_nonsense_latency_measurements_are_ignored(bad: float) -> None:
    stats = LiveStats()
    stats.observe_latency("a", 80.0)
    stats.observe_latency("a", bad)
    assert stats.latency_ms("a") == 80.0


def test_old_latency_observations_expire() -> None:
    clock = Clock()
    stats = LiveStats(stale_after=60.0, clock=clock)
    stats.observe_latency("a", 900.0)
    clock.now += 61
    assert stats.latency_ms("a") is None
    stats.observe_latency("a", 40.0)
    assert stats.latency_ms("a") == 40.0  # a fresh start, not blended with 900


def test_scoring_uses_observed_latency_over_the_health_checkers() -> None:
    clock = Clock()
    stats = LiveStats(clock=clock)
    snap = RouterSnapshot.build(
        backends=[backend("a", avg_latency_ms=20.0), backend("b", avg_latency_ms=90.0)]
    )
    stats.observe_latency("a", 800.0)
    route = Router().select(RequestRequirements(model="m"), snap, stats)
    assert route.target.backend.name == "b"
    latencies = {c.target.backend.name: c.latency_ms for c in route.decision.candidates}
    assert latencies == {"a": 800.0, "b": 90.0}


def test_stale_observation_falls_back_to_the_health_checkers_latency() -> None:
    clock = Clock()
    stats = LiveStats(stale_after=60.0, clock=clock)
    snap = RouterSnapshot.build(
        backends=[backend("a", avg_latency_ms=20.0), backend("b", avg_latency_ms=90.0)]
    )
    stats.observe_latency("a", 800.0)
    clock.now += 120
    route = Router().select(RequestRequirements(model="m"), snap, stats)
    assert route.target.backend.name == "a"


def test_as_dict_reports_every_backend_seen() -> None:
    stats = LiveStats()
    stats.begin("a")
    stats.observe_latency("b", 12.5)
    assert stats.as_dict() == {
        "a": {"in_flight": 1, "latency_ms": None},
        "b": {"in_flight": 0, "latency_ms": 12.5},
    }


def test_stats_survive_a_snapshot_swap() -> None:
    stats = LiveStats()
    router = Router()
    old = RouterSnapshot.build(version=1, backends=[backend("a"), backend("b")])
    for _ in range(3):
        stats.begin("a")
    new = RouterSnapshot.build(version=2, backends=[backend("a"), backend("b")])
    route = router.select(RequestRequirements(model="m"), new, stats)
    assert route.target.backend.name == "b"
    assert route.decision.snapshot_version == 2
    assert old.version == 1


def test_a_reported_load_moves_with_this_process_requests_until_the_next_report() -> (
    None
):
    stats = LiveStats()
    assert stats.load("w") == 0
    stats.report_load("w", 3)  # a relay worker's pong: every process's requests
    assert stats.load("w") == 3
    stats.begin("w")
    assert stats.load("w") == 4
    stats.end("w")
    stats.end("w")
    assert stats.load("w") == 2
    stats.report_load("w", 0)
    stats.begin("w")
    assert stats.load("w") == 1  # never below this process's own count
    stats.forget_load("w")
    assert stats.load("w") == 1
    assert "w" not in stats.reported_loads


def test_the_router_scores_a_backend_by_the_load_it_reports() -> None:
    snap = RouterSnapshot.build(
        version=1, backends=(backend("a", max_concurrency=8), backend("b"))
    )
    stats = LiveStats()
    router = Router()
    pick = lambda: router.select(RequestRequirements(model="m"), snap, stats)
    assert pick().target.backend.name == "a"  # a tie goes to the first
    stats.report_load("a", 5)  # busy with other serving processes' requests
    route = pick()
    assert route.target.backend.name == "b"
    shown = {c.target.backend.name: c.in_flight for c in route.decision.candidates}
    assert shown == {"a": 5, "b": 0}  # what --explain shows
    # Capacity stays this process's count: a stale report refuses nothing.
    stats.report_load("b", 50)
    stats.report_load("a", 8)
    assert pick().target.backend.name == "a"
