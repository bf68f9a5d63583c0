"""Long-lived work of a serving process, with one way to start and stop it.

A ``Service`` has a ``name``, a ``start()`` that begins its work on the running
event loop and returns at once, and an ``async stop()`` that ends it. Two kinds
cover most of what a process runs: ``TaskService`` (one long-lived coroutine,
such as a channel-layer listener) and ``periodic()`` (some work every so
often). ``start_in_order()`` and ``stop_in_reverse()`` run a list of them: what
starts last stops first, and no stop may hold the process's exit for longer
than its share of a time limit.

Standard library only: every layer of Nexus may use it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Service(Protocol):
    """Something a process starts on its event loop and stops at exit."""

    @property
    def name(self) -> str: ...

    def start(self) -> None:
        """Begin the work on the running event loop; return at once."""

    async def stop(self) -> None:
        """End the work (and hand on what it still holds)."""


class TaskService:
    """Run one long-lived coroutine in a task of its own until stopped.

    ``start()`` may be called again after ``stop()`` (or on another loop): each
    start runs a fresh coroutine.
    """

    def __init__(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._run = run
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        """Whether the task is there and has not ended."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the coroutine in a task (named after the service)."""
        task = asyncio.get_running_loop().create_task(self._run(), name=self.name)
        task.add_done_callback(self._log_end)
        self._task = task

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _log_end(self, task: asyncio.Task[None]) -> None:
        # Long-lived work ending on an exception would otherwise go unnoticed
        # until the task is collected.
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error("%s stopped on an error", self.name, exc_info=error)


class Periodic(TaskService):
    """Run `work` every `interval` seconds in a task (see ``periodic()``)."""

    def __init__(
        self,
        name: str,
        interval: float | Callable[[], float],
        work: Callable[[], object],
        *,
        immediately: bool,
        error: str,
        log: Callable[..., None],
    ) -> None:
        super().__init__(name, self._repeat)
        self._interval = interval if callable(interval) else _constant(interval)
        self._work = work
        self._immediately = immediately
        self._error = error
        self._log = log

    async def run_once(self) -> None:
        """Do the work once; an exception is logged, never raised."""
        try:
            result = self._work()
            if inspect.isawaitable(result):
                await result
        except Exception:  # noqa: BLE001 (`log` gets the traceback)
            self._log(self._error, exc_info=True)

    async def _repeat(self) -> None:
        if not self._immediately:
            await asyncio.sleep(self._interval())
        while True:
            await self.run_once()
            await asyncio.sleep(self._interval())


def _constant(value: float) -> Callable[[], float]:
    return lambda: value


def periodic(
    name: str,
    interval: float | Callable[[], float],
    work: Callable[[], object],
    *,
    immediately: bool = False,
    error: str | None = None,
    log: Callable[..., None] | None = None,
) -> Periodic:
    """Return a service that runs `work` every `interval` seconds.

    `work` is a plain function or a coroutine function. `interval` is seconds,
    or a function read before each wait (settings that may change). The first
    run comes after one interval, or at once with `immediately`. An exception
    from `work` is passed to `log` (``logger.warning`` of this module unless
    given: pass the caller's logger method to keep its name and level) with
    the message `error` and the traceback, and the next run comes as usual.
    Stopping cancels the wait, or the work where it awaits.
    """
    return Periodic(
        name,
        interval,
        work,
        immediately=immediately,
        error=error or f"{name} failed; running it again later",
        log=log or logger.warning,
    )


def start_in_order(services: Sequence[Service], started: list[Service]) -> None:
    """Start each of `services` in order, appending it to `started` once it runs.

    A start that raises leaves `started` holding the services to stop.
    """
    for service in services:
        service.start()
        started.append(service)


async def stop_in_reverse(services: Sequence[Service], within: float) -> list[str]:
    """Stop `services` last first, all of it within `within` seconds.

    Each stop may take the time left, less a reserve kept for every service
    still to stop (`within` / (2 x the number of services)): a stuck stop is
    abandoned at its bound, logged, and the next one runs, so one stuck
    service costs at most half the time and every other still gets its
    share. Returns the names of the services whose stop overran.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    reserve = within / (2 * len(services)) if services else 0.0
    overran: list[str] = []
    for after, service in reversed(list(enumerate(services))):
        bound = max(0.0, deadline - loop.time() - reserve * after)
        if not await _stop_within(service, bound):
            overran.append(service.name)
    return overran


async def _stop_within(service: Service, bound: float) -> bool:
    """Stop `service`, waiting at most `bound` seconds; False if it overran."""
    stopping = asyncio.get_running_loop().create_task(
        service.stop(), name=f"stop-{service.name}"
    )
    done, _ = await asyncio.wait({stopping}, timeout=bound)
    if not done:
        # Not awaited: a stop that ignores its cancellation must not hold us.
        stopping.cancel()
        logger.warning(
            "%s did not stop within %.3g s; going on without it", service.name, bound
        )
        return False
    if not stopping.cancelled() and (error := stopping.exception()) is not None:
        logger.error("Stopping %s failed", service.name, exc_info=error)
    return True
