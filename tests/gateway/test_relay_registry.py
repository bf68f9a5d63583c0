"""The relay registry: which heartbeats the database must hear of."""

from __future__ import annotations

import pytest

from gateway.relay.registry import WorkerRegistry
from nexus_worker import protocol

pytestmark = pytest.mark.mode_independent


async def _nothing() -> None:
    pass


def _state(
    expires_in: float | None = 300.0, vram: int = 4 * 10**9, slots: int | None = None
) -> protocol.BackendState:
    return protocol.BackendState(
        loaded=(protocol.LoadedModel("m", vram_bytes=vram, expires_in=expires_in),),
        memory_bytes=16 * 10**9,
        slots=slots,
    )


def _registry(now: list[float]) -> WorkerRegistry:
    registry = WorkerRegistry(clock=lambda: now[0])
    registry.join(1, "chan-1", 8, _nothing, _state())
    return registry


def test_the_first_state_is_written_then_the_same_heartbeats_are_not() -> None:
    now = [1000.0]
    registry = _registry(now)
    (written,) = registry.take_changes().values()
    assert written.loaded == {"m"}
    assert written.details["m"].vram_bytes == 4 * 10**9
    assert written.details["m"].expires_at.timestamp() == 1300.0
    assert written.memory_gb == 16.0
    for step in range(1, 20):
        # The same keep_alive read again later, give or take the pong's trip.
        now[0] = 1000.0 + 5 * step
        registry.note(1, _state(expires_in=300.0 - 5 * step + 0.3))
        assert registry.take_changes() == {}


def test_a_change_is_written_and_a_keep_alive_only_once_it_moved_a_minute() -> None:
    now = [1000.0]
    registry = _registry(now)
    registry.take_changes()
    now[0] = 1030.0
    registry.note(1, _state(expires_in=300.0))  # refreshed 30 s on: not yet
    assert registry.take_changes() == {}
    now[0] = 1070.0
    registry.note(1, _state(expires_in=300.0))  # 70 s on
    assert list(registry.take_changes()) == [1]
    registry.note(1, _state(expires_in=300.0, vram=5 * 10**9))
    assert registry.take_changes()[1].details["m"].vram_bytes == 5 * 10**9
    registry.note(1, protocol.BackendState(loaded=()))  # unloaded
    assert registry.take_changes()[1].loaded == frozenset()
    registry.note(1, _state(slots=2))  # capacity: the slots, under the worker's 8
    assert registry.take_changes()[1].max_concurrency == 2


def test_an_older_worker_says_nothing_and_a_worker_that_left_is_forgotten() -> None:
    now = [1000.0]
    registry = _registry(now)
    registry.take_changes()
    registry.note(1, None)
    assert registry.take_changes() == {}
    registry.note(1, _state(vram=1))
    registry.leave(1, "another-connection")  # a newer socket's: not this one
    assert registry.channels() == {1: "chan-1"}
    registry.leave(1, "chan-1")
    assert registry.take_changes() == {}
    assert len(registry) == 0
