"""The clock that pings a serving process's relay workers
(gateway/relay/heartbeats.py), on a clock of the test's."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.relay.heartbeats import STRETCH, HeartbeatClock


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Member:
    """A worker's consumer: counts its pings and the intervals they said."""

    def __init__(self, log: list[tuple[float, Member]], clock: Clock) -> None:
        self.log = log
        self.clock = clock
        self.intervals: list[float] = []

    async def beat(self, interval: float) -> None:
        self.log.append((self.clock.now, self))
        self.intervals.append(interval)


def _run(clock: Clock, heartbeats: HeartbeatClock, seconds: float, step: float = 0.05):
    """Tick every `step` seconds of the test's clock for `seconds`."""

    async def ticking() -> None:
        end = clock.now + seconds
        while clock.now < end:
            clock.now += step
            await heartbeats.tick()

    asyncio.run(ticking())


def _members(count: int, log: list, clock: Clock, heartbeats: HeartbeatClock) -> list:
    members = [Member(log, clock) for _ in range(count)]
    for member in members:
        heartbeats.join(member)
    return members


def test_a_few_workers_are_pinged_every_base_interval() -> None:
    clock, log = Clock(), []
    heartbeats = HeartbeatClock(5.0, 50.0, clock=clock)
    members = _members(10, log, clock, heartbeats)
    assert heartbeats.interval() == 5.0
    _run(clock, heartbeats, 31.0)
    pings = Counter(member for _, member in log)
    assert all(pings[member] == 6 for member in members)  # at 5, 10, ... 30 s
    assert {interval for m in members for interval in m.intervals} == {5.0}


@pytest.mark.parametrize("workers", [1000, 3000])
def test_many_workers_stretch_the_interval_and_keep_to_the_rate(workers: int) -> None:
    clock, log = Clock(), []
    heartbeats = HeartbeatClock(5.0, 50.0, clock=clock)
    # All at once, as after a restart: their pings still spread out.
    members = _members(workers, log, clock, heartbeats)
    interval = heartbeats.interval()
    assert interval == min(workers / 50.0, STRETCH * 5.0) == 20.0
    start = clock.now
    _run(clock, heartbeats, 120.0)
    rate = max(50.0, workers / interval)
    per_second = Counter(int(when - start) for when, _ in log)
    # The bucket allows a second's worth at most in one go.
    assert max(per_second.values()) <= 2 * rate
    # Over the whole run: every worker about every interval, not more often.
    pings = Counter(member for _, member in log)
    for member in members:
        assert 120.0 / interval - 2 <= pings[member] <= 120.0 / interval
        assert set(member.intervals) == {20.0}
    # No worker waited longer than the longest interval between two pings
    # (an older worker gives up after STRETCH + 1 of its base intervals).
    last: dict[Member, float] = {}
    for when, member in log:
        if member in last:
            assert when - last[member] <= STRETCH * 5.0 + 0.2
        last[member] = when


def test_a_worker_that_left_is_not_pinged_and_the_interval_shrinks_back() -> None:
    clock, log = Clock(), []
    heartbeats = HeartbeatClock(5.0, 50.0, clock=clock)
    members = _members(500, log, clock, heartbeats)
    assert heartbeats.interval() == 10.0
    gone = members[:400]
    for member in gone:
        heartbeats.leave(member)
    assert heartbeats.interval() == 5.0
    _run(clock, heartbeats, 30.0)
    pinged = {member for _, member in log}
    assert pinged.isdisjoint(gone)
    assert pinged == set(members[400:])


def test_a_worker_joining_again_is_pinged_once_an_interval() -> None:
    clock, log = Clock(), []
    heartbeats = HeartbeatClock(1.0, 50.0, clock=clock)
    (member,) = _members(1, log, clock, heartbeats)
    clock.now += 0.5
    heartbeats.join(member)  # it registered again on the same consumer
    _run(clock, heartbeats, 10.0)
    assert 9 <= len(log) <= 10
