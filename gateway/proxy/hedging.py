"""Hedged requests: a second attempt when the first is slow to start.

For a model with ``[routing.hedging."<model>"]``, ``forward`` runs its first
attempt through ``race()``: when that attempt has produced no byte after
``after_ms`` (or the model's observed p95 time to first byte, ``after =
"p95"``), the next-best backend of the route gets the same request, up to
``max_extra`` more. The first attempt to produce a byte wins (for an
OpenAI-protocol backend: its first stream event or its whole answer; through
a translating leg: its response head); the others are cancelled at once,
which closes their upstream connections. Only the winner's answer reaches
the client and is billed; the losers' prompt tokens (estimated) are counted
in ``nexus_hedge_waste_tokens``.

Never hedged: surfaces with side effects (Ollama model management goes
elsewhere; only the inference endpoints below are hedged), sheddable
requests (batch lines run there), and bodies over ``max_body_bytes``. A model
without hedging costs one lookup in an empty mapping.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.admission import CRITICALITY_HEADER
from gateway.metrics import GatewayMetrics
from routing.core import Target
from routing.core.traffic import HEDGE_AFTER_P95, HedgePolicy

if TYPE_CHECKING:
    from gateway.proxy.legs import Leg, ProxyExchange

# Inference only: nothing here changes state on a backend.
HEDGED_ENDPOINTS = frozenset(
    {"chat", "completions", "embeddings", "messages", "ollama-chat", "ollama-generate"}
)
# First-byte times kept per model, and how many are needed to trust a p95.
SAMPLES = 200
MIN_SAMPLES = 20


class FirstByteTimes:
    """Recent first-byte times of hedged models, per process (bounded)."""

    def __init__(self, samples: int = SAMPLES) -> None:
        self._samples = samples
        self._times: dict[str, deque[float]] = {}

    def observe(self, model: str, seconds: float) -> None:
        times = self._times.get(model)
        if times is None:
            times = self._times[model] = deque(maxlen=self._samples)
        times.append(seconds)

    def p95(self, model: str) -> float | None:
        """The model's p95 first-byte time in seconds, once enough were seen."""
        times = self._times.get(model)
        if times is None or len(times) < MIN_SAMPLES:
            return None
        ordered = sorted(times)
        # Nearest rank: the smallest time at least 95 % of them do not exceed.
        return ordered[math.ceil(len(ordered) * 0.95) - 1]

    def delay(self, policy: HedgePolicy) -> float:
        """Seconds to wait before hedging a request for the policy's model."""
        if policy.after == HEDGE_AFTER_P95:
            p95 = self.p95(policy.model)
            if p95 is not None:
                return p95
        return policy.after_ms / 1000


@dataclass(frozen=True, slots=True)
class HedgePlan:
    """How one request is hedged."""

    policy: HedgePolicy
    delay: float


def plan_hedge(
    exchange: ProxyExchange, target: Target, times: FirstByteTimes
) -> HedgePlan | None:
    """The request's hedging, or None (most requests: one dict lookup)."""
    state = exchange.state
    if state is None or not state.hedging:
        return None
    policy = state.hedging.get(target.model.name)
    if policy is None or exchange.endpoint not in HEDGED_ENDPOINTS:
        return None
    if len(exchange.raw) > policy.max_body_bytes:
        return None
    for name, value in exchange.request_headers:
        if name == CRITICALITY_HEADER and value.strip().lower() == b"sheddable":
            return None
    return HedgePlan(policy, times.delay(policy))


Attempt = Callable[[Target, "Leg | None", "str | None"], Coroutine[Any, Any, bool]]
Prepare = Callable[[Target], Awaitable["tuple[Leg | None, str | None] | None"]]


class Race:
    """One hedged request's attempts; the first to claim wins."""

    def __init__(
        self, exchange: ProxyExchange, metrics: GatewayMetrics, times: FirstByteTimes
    ) -> None:
        self.exchange = exchange
        self.metrics = metrics
        self.times = times
        self.tasks: dict[asyncio.Task[bool], tuple[Target, float]] = {}
        self.won = False
        self.tried: set[str] = set()  # backends raced: not retried after

    def start(
        self, attempt: Coroutine[Any, Any, bool], target: Target
    ) -> asyncio.Task[bool]:
        task: asyncio.Task[bool] = asyncio.get_running_loop().create_task(attempt)
        self.tasks[task] = (target, time.perf_counter())
        self.tried.add(target.backend.name)
        return task

    def claim(self) -> bool:
        """Called by an attempt at its first byte: True if it is the first,
        and then every other attempt is cancelled (its connection closed)."""
        current = asyncio.current_task()
        entry = self.tasks.get(current)  # type: ignore[arg-type]
        if entry is None:
            return True  # a retry after the race failed: no longer racing
        if self.won:
            return False
        self.won = True
        target, started = entry
        model = target.model.name
        self.times.observe(model, time.perf_counter() - started)
        exchange = self.exchange
        losers = [
            (task, loser)
            for task, (loser, _) in self.tasks.items()
            if task is not current
        ]
        if not losers:
            return True
        first = next(iter(self.tasks)) is current
        self.metrics.hedge_wins.labels(model, "first" if first else "hedge").inc()
        prompt = exchange.requirements.estimated_tokens if exchange.requirements else 0
        for task, loser in losers:
            if not task.done():
                task.cancel()
                self.metrics.hedge_waste.labels(loser.model.name).inc(prompt)
        exchange.hedge_backends = (
            target.backend.name,
            *(loser.backend.name for _, loser in losers),
        )
        return True


async def race(
    plan: HedgePlan,
    race_: Race,
    first: tuple[Target, Leg | None, str | None],
    spares: Sequence[Target],
    attempt: Attempt,
    prepare: Prepare,
) -> bool:
    """Run the first attempt, hedging it with spares while it has no byte.

    True once an attempt relayed the answer; False when every attempt started
    failed before answering (the caller goes on with the untried targets).
    """
    running = {race_.start(attempt(*first), first[0])}
    extra = 0
    waiting = list(spares)
    try:
        while running:
            hedging = extra < plan.policy.max_extra and waiting and not race_.won
            done, running = await asyncio.wait(
                running,
                timeout=plan.delay if hedging else None,
                return_when=asyncio.FIRST_COMPLETED,
            )
            for task in done:
                # A loser cancelled by the winner's claim ends here too.
                if not task.cancelled() and task.result():
                    return True
            if done or not hedging:
                continue
            while waiting:
                spare = waiting.pop(0)
                if spare.backend.name in race_.tried:
                    continue
                prepared = await prepare(spare)
                if prepared is None:
                    continue
                extra += 1
                race_.exchange.hedged = True
                race_.metrics.hedges.labels(spare.model.name).inc()
                running.add(race_.start(attempt(spare, *prepared), spare))
                break
        return False
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
