"""Relay workers in the router core: least loaded, round-robin ties, their
reported load in the fleet queue depth."""

from __future__ import annotations

import pytest

from routing.core import LiveStats, RequestRequirements, Router
from tests.routing.core_builders import backend, snapshot

pytestmark = pytest.mark.mode_independent

NEED = RequestRequirements(model="m")


def _chosen(router: Router, snap: object, stats: LiveStats) -> str:
    return router.select(NEED, snap, stats).target.backend_name  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["smart", "fleet"])
def test_equal_workers_take_turns_and_equal_direct_backends_do_not(
    strategy: str,
) -> None:
    workers = snapshot(
        *(backend(f"gpu-{i}", "m", kind="relay") for i in range(3)), strategy=strategy
    )
    router, stats = Router(), LiveStats()
    assert [_chosen(router, workers, stats) for _ in range(6)] == [
        "gpu-0",
        "gpu-1",
        "gpu-2",
        "gpu-0",
        "gpu-1",
        "gpu-2",
    ]
    direct = snapshot(*(backend(f"box-{i}", "m") for i in range(3)), strategy=strategy)
    assert {_chosen(router, direct, stats) for _ in range(6)} == {"box-0"}


def test_the_least_loaded_worker_wins_however_the_turns_go() -> None:
    snap = snapshot(*(backend(f"gpu-{i}", "m", kind="relay") for i in range(3)))
    router, stats = Router(), LiveStats()
    stats.report_load("gpu-0", 2)  # its pongs: another process's requests
    stats.report_load("gpu-1", 1)
    assert {_chosen(router, snap, stats) for _ in range(4)} == {"gpu-2"}


def test_a_workers_reported_load_is_its_fleet_queue_depth() -> None:
    """Requests another serving process sent (the worker's pong says so)
    count in the queue penalty, as this process's own do."""
    snap = snapshot(
        backend("gpu-busy", "m", kind="relay"),
        backend("gpu-idle", "m", kind="relay", priority=20),
        strategy="fleet",
    )
    router, stats = Router(), LiveStats()
    assert stats.queue_depth("gpu-busy", "m") == 0
    stats.report_load("gpu-busy", 3)
    assert stats.queue_depth("gpu-busy", "m") == 3
    assert {_chosen(router, snap, stats) for _ in range(3)} == {"gpu-idle"}
