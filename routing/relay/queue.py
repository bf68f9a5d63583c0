"""Waiting for a relay worker with room: a bounded FIFO per serving process.

When every backend of a model is at its max_concurrency and some of them are
relay workers, the request waits here for a slot instead of failing at once
(the seed's central queue): first come, first served, at most
``NEXUS_RELAY_QUEUE_MAX`` waiting (then 503 ``queue_full``), each for at most
``NEXUS_RELAY_QUEUE_TIMEOUT`` seconds (then 503 ``queue_timeout``).

It is deliberately minimal: one queue per process, woken when a relay request
of this process ends and retried every second (a slot freed by another
process, a worker that registers). The fleet strategy's per backend x model
queues are meant to replace it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import TYPE_CHECKING

from routing.core import Health, NoHealthyBackend, Route
from routing.proxy.errors import ProxyError
from routing.relay.dispatch import RELAY_KIND

if TYPE_CHECKING:
    from routing.core import LiveStats, RequestRequirements, RouterSnapshot
    from routing.gateway import Gateway
    from routing.state import GatewayState

RETRY_SECONDS = 1.0


class _Waiter:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()


class RelayQueue:
    """Requests waiting for a relay worker's slot, oldest first."""

    def __init__(self, max_waiting: int = 100, timeout: float = 30.0) -> None:
        self.max_waiting = max_waiting
        self.timeout = timeout
        self._waiting: deque[_Waiter] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def wake_first(self) -> None:
        """A slot was freed: the oldest waiter not yet woken tries again."""
        for waiter in self._waiting:
            if not waiter.event.is_set():
                waiter.event.set()
                return

    async def select(
        self, gateway: Gateway, requirements: RequestRequirements, state: GatewayState
    ) -> Route:
        """Route the request, waiting in line while relay workers are all busy."""
        router, stats = gateway.router, gateway.stats
        try:
            return router.select(requirements, state.routes, stats)
        except NoHealthyBackend:
            if not _relay_is_busy(state.routes, requirements.model, stats):
                raise
        if len(self._waiting) >= self.max_waiting:
            raise ProxyError(
                503,
                f"Every worker for model '{requirements.model}' is busy and "
                f"{self.max_waiting} requests already wait for one. Retry shortly.",
                error_type="server_error",
                code="queue_full",
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        waiter = _Waiter()
        self._waiting.append(waiter)
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise _timed_out(requirements.model, self.timeout)
                waiter.event.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        waiter.event.wait(), min(RETRY_SECONDS, remaining)
                    )
                latest = gateway.snapshots.peek() or state
                try:
                    return router.select(requirements, latest.routes, stats)
                except NoHealthyBackend:
                    if not _relay_is_busy(latest.routes, requirements.model, stats):
                        raise
        finally:
            self._waiting.remove(waiter)


def _timed_out(model: str, timeout: float) -> ProxyError:
    return ProxyError(
        503,
        f"No worker for model '{model}' had room within {timeout:g} s. Retry later.",
        error_type="server_error",
        code="queue_timeout",
    )


def _relay_is_busy(routes: RouterSnapshot, model: str, stats: LiveStats) -> bool:
    """Whether a healthy relay worker serves `model` but is at capacity."""
    name = routes.aliases.get(model, model)
    served = routes.routes.get(name)
    if served is None:
        return False
    return any(
        target.backend.kind == RELAY_KIND
        and target.backend.enabled
        and target.backend.status == Health.HEALTHY
        and stats.in_flight(target.backend.name) >= target.backend.capacity
        for target in served.targets
    )
