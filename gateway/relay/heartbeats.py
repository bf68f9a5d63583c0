"""One clock pings every relay worker connected to this serving process.

A heartbeat is a ping frame to the worker and its pong back. Each costs the
process about a quarter of a millisecond of CPU in Twisted, autobahn and
Channels, whatever it carries (``make bench-heartbeats``): a 1,000-worker
fleet pinged every 5 s kept 12 % of a core busy doing nothing else. So, as
Nomad scales its clients' heartbeat TTLs with the cluster, the interval
stretches with the number of workers connected here to keep the pings under
``per_second`` (``NEXUS_RELAY_HEARTBEATS_PER_SECOND``, 50):

    interval = clamp(workers / per_second, base, STRETCH x base)

where ``base`` is ``NEXUS_RELAY_HEARTBEAT_SECONDS`` (5 s). Up to 250 workers
per process nothing changes; 1,000 are pinged every 20 s. A worker that
leaves 3 pings unanswered is still Gone (its silence noticed within 3
intervals), and a closed socket still at once. The ping says the interval
(``Ping.interval``) so the worker waits long enough before it gives up on a
silent gateway; an older worker, which waits 5 of its register_ack's
intervals, is pinged at most every ``STRETCH`` x base, which keeps it.

One task pings them all (1,000 sleeping tasks cost their timers besides),
each when its interval is up. After a restart, when every worker registers
within seconds, their first pings are spread at the rate, so they do not
come in bursts.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from typing import Protocol

from nexus_lib.service import TaskService
from nexus_worker import protocol

logger = logging.getLogger(__name__)

# NEXUS_RELAY_HEARTBEATS_PER_SECOND's default (Nomad's max_heartbeats_per_second).
DEFAULT_HEARTBEATS_PER_SECOND = 50.0
# The longest interval, in base intervals: an older worker gives up after
# MISSED_HEARTBEATS_BEFORE_GONE + 2 of its register_ack's intervals.
STRETCH = protocol.MISSED_HEARTBEATS_BEFORE_GONE + 1
# The clock wakes at least this often (a worker joining is due an interval on),
# and at most this often (the pings due within it go together).
_LONGEST_SLEEP = 1.0
_SHORTEST_SLEEP = 0.1


class Beating(Protocol):
    """A worker's consumer, as the clock sees it."""

    async def beat(self, interval: float) -> None:
        """Ping the worker, or give it up (3 pings unanswered)."""


class HeartbeatClock:
    """Pings this process's workers (see the module docstring).

    A service: ``start()`` runs the clock in a task, ``stop()`` ends it.
    """

    name = "relay-heartbeats"

    def __init__(
        self,
        base: float,
        per_second: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base = base
        self.per_second = per_second
        self.clock = clock
        # (due, sequence, member); a member's entry is live while its
        # sequence is the one in self._members.
        self._due: list[tuple[float, int, Beating]] = []
        self._members: dict[Beating, int] = {}
        self._sequence = itertools.count()
        # The earliest first ping of the next worker to join.
        self._next_slot = 0.0
        self._task = TaskService(self.name, self.run)

    def __len__(self) -> int:
        return len(self._members)

    def interval(self) -> float:
        """Seconds between two pings of a worker, for the workers here now."""
        return self._interval_for(len(self._members))

    def join(self, member: Beating) -> float:
        """Ping `member` from an interval on; return that interval.

        Workers joining together (a restart: all of them within seconds)
        get their first pings at the rate apart, so they stay spread.
        """
        self._members.pop(member, None)
        workers = len(self._members) + 1
        interval = self._interval_for(workers)
        due = max(self.clock() + interval, self._next_slot)
        # per_second, unless the interval is at its longest.
        self._next_slot = due + 1.0 / max(self.per_second, workers / interval)
        self._schedule(member, due)
        return interval

    def leave(self, member: Beating) -> None:
        self._members.pop(member, None)

    def _interval_for(self, workers: int) -> float:
        stretched = workers / self.per_second
        return min(max(self.base, stretched), STRETCH * self.base)

    def _schedule(self, member: Beating, due: float) -> None:
        sequence = next(self._sequence)
        self._members[member] = sequence
        heapq.heappush(self._due, (due, sequence, member))

    # Lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self._sleep())

    async def tick(self) -> int:
        """Ping the workers whose interval is up; return how many."""
        now = self.clock()
        interval = self.interval()
        pinged = 0
        while self._due and self._due[0][0] <= now:
            due, sequence, member = heapq.heappop(self._due)
            if self._members.get(member) != sequence:
                continue  # it left, or joined again
            # The next from when this one was due: a late tick (a busy
            # process) does not push the worker's pings later each time.
            self._schedule(member, max(due + interval, now + _SHORTEST_SLEEP))
            pinged += 1
            try:
                await member.beat(interval)
            except Exception:
                logger.exception("A relay heartbeat failed")
        return pinged

    def _sleep(self) -> float:
        if not self._due:
            return _LONGEST_SLEEP
        wait = self._due[0][0] - self.clock()
        return min(max(wait, _SHORTEST_SLEEP), _LONGEST_SLEEP)
