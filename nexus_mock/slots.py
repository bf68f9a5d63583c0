"""The mock backend's --slots: how many requests it runs at once, and holds.

A request past the slots waits for one in arrival order, as a model server
queues the work it cannot run yet, and a freed slot passes straight to the
oldest waiter. POST /_mock/hold holds the next N requests in their slots until
the Nth arrives (or /_mock/release, or ``HOLD_SECONDS``), so that a test sees
them at the mock at once however slowly a loaded machine sends them.
"""

from __future__ import annotations

import asyncio
from collections import deque

from nexus_mock.protocol import HttpConnection
from nexus_mock.stats import MockStats

# The longest a request is held by POST /_mock/hold.
HOLD_SECONDS = 30.0


class Slots:
    """The requests waiting for a slot, and those held in theirs."""

    def __init__(self, stats: MockStats) -> None:
        # Counts slots in use (busy_slots) and waiters, with their peaks.
        self._stats = stats
        # Requests waiting for one of the --slots, in arrival order.
        self._waiters: deque[asyncio.Future[None]] = deque()
        # How many more requests in a slot are held, and the ones held
        # (released together when the last of them arrives).
        self._hold_left = 0
        self._held: list[asyncio.Future[None]] = []

    async def acquire(self, conn: HttpConnection, slots: int) -> bool:
        """Take one of ``slots``, waiting in arrival order; False if the client left."""
        stats = self._stats
        if stats.busy_slots < slots and not self._waiters:
            stats.busy_slots += 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(turn)
            stats.waiting_for_slot += 1
            stats.note_slots()
            try:
                got_slot = await conn.wait_for(turn)
            finally:
                stats.waiting_for_slot -= 1
                if not turn.done():
                    turn.cancel()
                    self._waiters.remove(turn)
            if not got_slot:
                return False
        stats.note_slots()
        return True

    def release(self) -> None:
        """Free a slot: it passes straight to the oldest waiter, if there is one."""
        waiters = self._waiters
        while waiters:
            turn = waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._stats.busy_slots -= 1

    def hold_next(self, first: int) -> None:
        """Hold the next ``first`` requests that get a slot until the last arrives."""
        self.release_held()
        self._hold_left = first

    async def hold(self, conn: HttpConnection) -> bool:
        """Hold this request (in its slot) if POST /_mock/hold asked for it,
        until the last of those arrives, /_mock/release, or HOLD_SECONDS;
        False if the client left meanwhile."""
        if not self._hold_left:
            return True
        self._hold_left -= 1
        if not self._hold_left:
            self.release_held()
            return True
        held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.append(held)
        timer = asyncio.get_running_loop().call_later(HOLD_SECONDS, _resolve, held)
        try:
            return await conn.wait_for(held)
        finally:
            timer.cancel()

    def release_held(self) -> int:
        """Let every held request go, and stop holding; return how many were."""
        self._hold_left = 0
        held, self._held = self._held, []
        for future in held:
            _resolve(future)
        return len(held)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
