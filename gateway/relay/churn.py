"""Configuration versions from relay workers' comings and goings, coalesced.

Every change a worker's connection makes to the database (register, a
``models_update``, its socket closing) is a new configuration version, and
every serving process rebuilds its snapshot for each. A worker reconnecting
in a loop made one version per reconnect (the red team's 1,000 reconnects in
33 s: 1,001 versions, direct and relay latency 2.5x and 4.4x). Here those
writes run inside ``config_changes_deferred()``, and this process bumps the
version for them at most once per ``interval``: the first change at once (a
worker that connects is routable as soon as before), later ones in the same
interval together at its end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from channels.db import database_sync_to_async

from routing.versioning import bump_and_broadcast, config_changes_deferred

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ConfigChurn:
    """This process's coalescer of worker-caused configuration versions."""

    def __init__(
        self,
        interval: float,
        *,
        bump: Callable[[], Any] = bump_and_broadcast,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self._bump = bump
        self._clock = clock
        self._last = -interval  # when the last bump started
        self._due: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.bumps = 0

    async def run(self, write: Callable[..., T], *args: Any) -> T:
        """Run the database write `write(*args)` in the sync thread, its
        configuration change (if any) coalesced with the others."""

        def deferred() -> tuple[T, bool]:
            with config_changes_deferred() as changes:
                result = write(*args)
            return result, changes.changed

        result, changed = await database_sync_to_async(deferred)()
        if changed:
            await self.changed()
        return result

    async def changed(self) -> None:
        """A change committed: bump now if the last bump is an interval old,
        else once at the end of the interval (for every change until then)."""
        if self._due is not None:
            return  # the bump at the end of this interval covers it
        wait = self._last + self.interval - self._clock()
        if wait <= 0:
            await self._bump_now()
            return
        loop = asyncio.get_running_loop()
        self._due = loop.call_later(wait, self._start_due)

    def _start_due(self) -> None:
        task = asyncio.get_running_loop().create_task(self._bump_due())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _bump_due(self) -> None:
        self._due = None
        await self._bump_now()

    async def _bump_now(self) -> None:
        self._last = self._clock()
        try:
            await database_sync_to_async(self._bump)()
            self.bumps += 1
        except Exception:
            # Retried once the interval is over: the change is committed and
            # must reach the other processes.
            logger.warning("Could not bump the configuration version", exc_info=True)
            if self._due is None:
                loop = asyncio.get_running_loop()
                self._due = loop.call_later(self.interval, self._start_due)
