"""The async glue between the proxy and the admission core.

One ``AdmissionGate`` per gateway (serving process). The proxy calls
``prepare()`` and ``await admit()`` for every inference request, on every
surface, before a backend is chosen, and hands the ticket to ``release()`` in
a ``finally``
whatever happens next (an answer, an error, a retry on another backend, a
client that hangs up, a stream cut half-way), so the stock returns to
exactly 0 at rest. A request that must wait awaits a future the core
resolves from the release that frees its place (event-driven, no polling);
a timer fires at the next TTL or deadline, and a safety timer pumps the
queues once a second. If the dequeueing machinery fails, everything waiting
is let through (fail-open); if enqueueing fails, the request gets an error
(fail-closed).

A pool holds the requests for the model that will serve them: the first of
the name, its alias target and its fallbacks (the router's order) with a
ready backend; its band comes from that model's ready backends. A model with
none bypasses admission and gets the router's own error. Each new snapshot
(``state_installed()``) resizes the pools that hold requests at once: a
backend or relay worker that turns ready takes the waiting requests before
new arrivals, and the requests of a model left with no ready backend go on
to the router.

Several serving processes each run their own queue and take their share of
each pool's band (``AdmissionSettings.band``): with Redis, from a registry of
live processes (a sorted set of heartbeats, refreshed off the request path);
without it, from the launcher's ``NEXUS_SERVING_PROCESSES`` and
``NEXUS_SERVING_INDEX`` (one process when unset).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from gateway.admission_places import FLOW_FULL, LocalPlaces, Places
from nexus_lib.service import Service, periodic
from routing.admission.controller import AdmissionController, error_of
from routing.admission.errors import (
    AdmissionError,
    ClientCancelled,
    DeadlineExceeded,
    FlowQueueFull,
    Preempted,
    QueueFull,
    QueueTTLExpired,
)
from routing.admission.queue import Ticket
from routing.admission.vocabulary import Criticality, FlowKey, Outcome, StockUnit
from routing.core import RequestRequirements, RouterSnapshot
from routing.core.types import UNLIMITED, PreparedTarget
from usage.live import AdmissionLiveDict, AdmissionPoolDict

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics
    from routing.state import GatewayState

logger = logging.getLogger(__name__)

CRITICALITY_HEADER = b"x-nexus-criticality"
DEADLINE_HEADER = b"x-nexus-deadline-ms"
# The official OpenAI SDKs send their request timeout (seconds) on every call.
SDK_TIMEOUT_HEADER = b"x-stainless-timeout"
MAX_DEADLINE_SECONDS = 24 * 3600.0
SAFETY_INTERVAL = 1.0
# A request finding the gateway's queue full sheds at most this many less
# critical ones waiting here (more only when their places were not counted).
PREEMPTIONS_PER_ARRIVAL = 4
HEARTBEAT_SECONDS = 1.0
STALE_AFTER_SECONDS = 3.5
REGISTRY_KEY = "nexus:admission:processes"
PROCESSES_ENV = "NEXUS_SERVING_PROCESSES"
INDEX_ENV = "NEXUS_SERVING_INDEX"


class BadAdmissionHeader(ValueError):
    """A client's admission header cannot be read (the proxy answers 400)."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


class AdmissionGate:
    """Admission control for one serving process (see the module docstring).

    A service (nexus_lib.service): ``start()`` runs the safety timer (and the
    registry heartbeat with Redis), ``stop()`` ends them and lets through
    what still waits.
    """

    name = "admission"

    def __init__(
        self,
        metrics: GatewayMetrics | None = None,
        *,
        share: str = "single",
        places: Places | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = AdmissionController(clock=clock)
        self.places: Places = places or LocalPlaces()
        self.metrics = metrics
        self.share = share
        self.clock = clock
        self._state: GatewayState | None = None
        self._pools: dict[str, Pool | None] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = math.inf
        self._timers: list[Service] = [
            periodic("admission-safety", SAFETY_INTERVAL, self._pump_all)
        ]
        if share == "redis":
            self._timers.append(_ProcessRegistry(self._take_share))
        self._seen_attempts = 0
        self._seen_successes = 0
        if share == "env":
            self.controller.set_share(*_share_from_environment())

    # Lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Start the safety timer (and the registry heartbeat) on the running loop."""
        self._loop = asyncio.get_running_loop()
        for timer in self._timers:
            timer.start()

    async def stop(self) -> None:
        """Stop the timers; what still waits is let through."""
        await asyncio.gather(
            *(timer.stop() for timer in self._timers), return_exceptions=True
        )
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._expiry_at = math.inf
        # Nobody will release what still waits: let it through (fail-open).
        self.controller.open_all()

    # The request path ------------------------------------------------------

    def prepare(
        self,
        state: GatewayState,
        requirements: RequestRequirements,
        payload: Mapping[str, Any],
        key_prefix: str,
        headers: list[tuple[bytes, bytes]],
        *,
        batch: bool = False,
    ) -> Ticket | None:
        """The request's ticket, or None when admission control does not apply.

        A batch job's line (`batch`) waits in the batch lane, behind every
        interactive request (routing.admission.batch_lane), at sheddable.

        Raises BadAdmissionHeader for an X-Nexus-Criticality or
        X-Nexus-Deadline-Ms the gateway cannot read.
        """
        if state is not self._state:
            self._use(state)
        settings = state.admission
        if not settings.enabled:
            return None
        model = requirements.model
        pools = self._pools
        pool = pools[model] if model in pools else self._pool_of(state, model)
        if pool is None:
            return None
        criticality = Criticality.DEFAULT
        deadline: float | None = None
        for name, value in headers:
            if name == CRITICALITY_HEADER:
                criticality = _parse_criticality(value)
            elif name == DEADLINE_HEADER:
                deadline = _parse_deadline(value, 1000.0, strict=True)
            elif name == SDK_TIMEOUT_HEADER and deadline is None:
                deadline = _parse_deadline(value, 1.0, strict=False)
        limits = state.key_admission.get(key_prefix)
        weight = settings.weight_of(model)
        if limits is not None:
            criticality = min(criticality, limits.max_criticality)
            weight *= limits.weight
        if batch:
            criticality = Criticality.SHEDDABLE
        return Ticket(
            flow=_flow(settings.flow_key, key_prefix, model),
            criticality=criticality,
            size=settings.size_of(
                requirements.estimated_tokens,
                _max_tokens(payload),
                model,
                state.routes.alias_for(model) or model,
            ),
            weight=weight,
            model=model,
            deadline=None if deadline is None else self.clock() + deadline,
            pool_key=pool.key,
            ready=pool.ready,
            capacities=pool.capacities,
            backends=pool.backends,
            batch=batch,
        )

    async def admit(self, ticket: Ticket) -> None:
        """Return when the request may go to a backend.

        Raises AdmissionError (queue full, flow full, TTL, preempted,
        deadline). A client that hangs up cancels the await; the caller's
        ``release()`` then takes the request out of the queue at once.
        """
        model = ticket.model
        controller = self.controller
        try:
            # A batch line takes no gateway-wide queue place: it never
            # crowds out an interactive request.
            if not ticket.batch and not controller.bypasses(
                ticket.pool_key, ticket.ready, ticket.capacities, ticket.backends
            ):
                await self._take_places(ticket)
            controller.admit(
                ticket,
                ticket.pool_key,
                ticket.ready,
                ticket.capacities,
                ticket.backends,
            )
        except AdmissionError as error:
            self._give_back(ticket)
            if self.metrics is not None:
                self.metrics.admission_refused(model, ticket.pool_key, error.code)
            raise
        except BaseException as error:
            self._give_back(ticket)
            if not isinstance(error, Exception):
                raise  # cancelled: the client left
            logger.exception("Admission failed to queue a request")
            raise  # fail-closed: the proxy answers 500
        if ticket.outcome is Outcome.BYPASSED:
            self._give_back(ticket)
            if self.metrics is not None:
                self.metrics.admission_bypass(model, ticket.pool_key)
            return
        if ticket.outcome is None:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def wake(decided: Ticket) -> None:
                self._give_back(decided)
                if not waiter.done():
                    waiter.set_result(None)

            ticket.on_done = wake
            self._arm_expiry(ticket)
            await waiter
        else:
            self._give_back(ticket)  # sent on at once by the queue's pump
        if self.metrics is not None:
            self.metrics.admission_decided(ticket)
        refusal = error_of(ticket)
        if refusal is not None:
            raise refusal

    async def _take_places(self, ticket: Ticket) -> None:
        """Take the request's gateway-wide queue places (``admission_places``).

        When the gateway's queue is full, a less critical request waiting in
        this process gives up its place (preempted), as in a pool's own full
        queue; other processes' waiting requests are not reached from here.
        Raises QueueFull or FlowQueueFull.
        """
        try:
            await self._take_places_or_refuse(ticket)
        except AdmissionError as error:
            self.controller.count_refusal(error.code)
            raise

    async def _take_places_or_refuse(self, ticket: Ticket) -> None:
        settings = self.controller.settings
        critical = ticket.criticality is Criticality.CRITICAL
        for _ in range(PREEMPTIONS_PER_ARRIVAL + 1):
            taken = await self.places.take(ticket.flow, critical, settings)
            if not isinstance(taken, str):
                ticket.held = taken
                return
            if taken == FLOW_FULL:
                raise _flow_full(settings.flow_capacity)
            if not self.controller.preempt_below(ticket.criticality):
                break
        if critical:  # guaranteed capacity: short of total_capacity critical ones
            taken = await self.places.take(ticket.flow, True, settings, over=True)
            if not isinstance(taken, str):
                ticket.held = taken
                return
            if taken == FLOW_FULL:
                raise _flow_full(settings.flow_capacity)
        where = (
            "every model and serving process" if self.places.shared else "every model"
        )
        if critical:
            why = f"{settings.total_capacity} critical requests wait"
        elif settings.critical_reserved:
            why = (
                f"{settings.total_capacity} requests may wait, "
                f"{settings.critical_reserved} places of them kept for critical ones"
            )
        else:
            why = f"{settings.total_capacity} requests may wait"
        raise QueueFull(
            f"The gateway's admission queue is full ({why}, over {where}); retry later."
        )

    def _give_back(self, ticket: Ticket) -> None:
        held, ticket.held = ticket.held, None
        if held is not None:
            self.places.give_back(held)

    def release(self, ticket: Ticket | None) -> None:
        """The request is over (any way at all); safe to call twice."""
        if ticket is None or ticket.released:
            return
        waiting = ticket.outcome is None
        try:
            self.controller.release(ticket)
        except Exception:
            logger.exception("Admission failed to release a request; letting all in")
            self._fail_open()
            return
        if waiting and self.metrics is not None:
            self.metrics.admission_decided(ticket)

    def state_installed(self, state: GatewayState) -> None:
        """A new snapshot is the one routed with: resize the pools holding
        requests to their models' ready backends now (not at the next
        arrival), so what waits goes first to a backend that turned ready."""
        loop = self._loop
        if loop is None:
            return  # not started: the first prepare() takes the state
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            loop.call_soon_threadsafe(self.state_installed, state)
            return
        self._guard(self._resize_all, state)

    # Views -----------------------------------------------------------------

    def snapshot(self) -> AdmissionLiveDict:
        """What the dashboard shows: per pool stock and band, per flow waiting.

        Off the request path (the usage publisher, twice a second at most).
        """
        models_of: dict[str, list[str]] = {}
        for model, route in self._pools.items():
            if route is not None:
                models_of.setdefault(route.key, []).append(model)
        pools: list[AdmissionPoolDict] = []
        tokens = self.controller.settings.stock_unit is StockUnit.TOKENS
        for pool in self.controller.pools.values():
            band = pool.band
            pools.append(
                {
                    "pool": pool.key,
                    "backends": list(pool.backends),
                    "models": sorted(models_of.get(pool.key, pool.stock_by_model)),
                    "unit": "tokens" if tokens else "requests",
                    "stock": round(pool.stock_tokens) if tokens else pool.stock,
                    "waiting": len(pool.queue),
                    "lower": band.lower,
                    "upper": band.upper,
                    "watermark": band.watermark,
                    "dispatch_limit": (
                        band.token_dispatch_limit if tokens else band.dispatch_limit
                    ),
                    "bypass_limit": (
                        band.token_bypass_limit if tokens else band.bypass_limit
                    ),
                    "flows": pool.queue.flow_lengths(),
                }
            )
        counts = self.controller.counts
        rejections = dict(counts.refused)
        for code, count in (
            (QueueTTLExpired.code, counts.expired),
            (DeadlineExceeded.code, counts.deadline),
            (Preempted.code, counts.preempted),
            (ClientCancelled.code, counts.cancelled),
        ):
            if count:
                rejections[code] = rejections.get(code, 0) + count
        return {
            "enabled": self.controller.settings.enabled,
            "pools": pools,
            "rejections": rejections,
            "preemptions": dict(counts.preempted_by),
            "bypassed": counts.bypassed,
            "dispatched": counts.dispatched,
            "changes": counts.events,
        }

    def refresh_metrics(self) -> None:
        """Copy the gauges (periodically and when /metrics is scraped)."""
        if self.metrics is None:
            return
        counts = self.controller.counts
        self.metrics.set_admission(
            self.controller.pools.values(),
            self.controller.waiting_tickets(),
            counts.dequeue_attempts - self._seen_attempts,
            counts.dequeue_successes - self._seen_successes,
            self.controller.processes,
        )
        self._seen_attempts = counts.dequeue_attempts
        self._seen_successes = counts.dequeue_successes
        self.metrics.set_batch_lanes(
            self.controller.batch_waiting, self.controller.batch_running
        )

    # Internals -------------------------------------------------------------

    def _use(self, state: GatewayState) -> None:
        self._state = state
        self._pools.clear()
        if state.admission != self.controller.settings:
            self._guard(self.controller.configure, state.admission)
        self.controller.forget_idle_pools()

    def _resize_all(self, state: GatewayState) -> None:
        if state is not self._state:
            self._use(state)
        routes = state.routes
        waits = routes.policy.waits_at_backends
        for key in list(self.controller.pools):
            model_routes = routes.routes.get(key)
            if model_routes is not None and model_routes.routable:
                pool = _pool_from(key, model_routes.routable, waits)
                self.controller.resize(key, pool.ready, pool.capacities, pool.backends)
            else:
                self.controller.open_pool(key)

    def _pool_of(self, state: GatewayState, model: str) -> Pool | None:
        """The pool of the backends that will serve `model`, cached per snapshot.

        The router's order: the name itself, its alias target, then the
        fallback chain; the first of them with a ready backend is the one the
        router serves from, so its backends are the pool (an alias or a
        fallback is counted with the model that actually runs it).
        """
        routes = state.routes
        target = routes.aliases.get(model)
        if (
            model not in routes.routes
            and target is None
            and model not in routes.fallbacks
            and model not in routes.splits
        ):
            pattern = routes.alias_pattern_for(model)
            if pattern is None:
                return None  # unknown: the router answers 404, nothing is cached
            # Clients choose the names a pattern covers: cache the pattern's
            # pool once, not one entry per name.
            if pattern not in self._pools:
                self._pools[pattern] = _first_pool(routes, routes.models_for(pattern))
            return self._pools[pattern]
        pool = _first_pool(routes, routes.models_for(model))
        self._pools[model] = pool
        return pool

    def _arm_expiry(self, ticket: Ticket) -> None:
        due = self.clock() + self.controller.settings.queue_ttl
        if ticket.deadline is not None:
            due = min(due, ticket.deadline)
        if due >= self._expiry_at:
            return
        self._schedule_expiry(due)

    def _schedule_expiry(self, due: float) -> None:
        loop = self._loop or asyncio.get_running_loop()
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_at = due
        self._expiry = loop.call_later(max(0.0, due - self.clock()), self._expire)

    def _expire(self) -> None:
        self._expiry = None
        self._expiry_at = math.inf
        following = self._guard(self.controller.expire)
        if following is not None:
            self._schedule_expiry(following)

    def _pump_all(self) -> None:
        """Pump every queue and expire what is due (the safety timer's tick)."""
        self._guard(self.controller.pump_all)
        following = self._guard(self.controller.expire)
        if following is not None and following < self._expiry_at:
            self._schedule_expiry(following)

    def _guard(self, action: Callable[..., Any], *args: Any) -> Any:
        try:
            return action(*args)
        except Exception:
            logger.exception("Admission control failed; letting waiting requests in")
            self._fail_open()
            return None

    def _fail_open(self) -> None:
        try:
            self.controller.open_all()
        except Exception:
            logger.exception("Could not open the admission queues")

    def _take_share(self, members: list[str], me: str) -> None:
        """Take this process's share of the band from the live registry."""
        if me in members:
            self._guard(self.controller.set_share, members.index(me), len(members))


class _ProcessRegistry:
    """Keeps this process in the live registry of serving processes (Redis).

    A heartbeat a second adds it (and drops those gone stale); each answer,
    the members in order, goes to `take_share`. Stopping leaves the registry.
    """

    name = "admission-share"

    def __init__(self, take_share: Callable[[list[str], str], None]) -> None:
        self._take_share = take_share
        self._client: Any = None
        self._me = ""
        self._heartbeat = periodic(
            "admission-share",
            HEARTBEAT_SECONDS,
            self._beat,
            immediately=True,
            error="Could not reach the process registry",
            log=logger.warning,
        )

    def start(self) -> None:
        """Start the heartbeat on the running loop (its first beat at once)."""
        from django.conf import settings as django_settings  # only in Redis mode
        from redis import asyncio as redis_asyncio

        self._me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._client = redis_asyncio.from_url(django_settings.REDIS_URL)
        self._heartbeat.start()

    async def stop(self) -> None:
        """Stop the heartbeat and leave the registry."""
        await self._heartbeat.stop()
        client, self._client = self._client, None
        if client is None:
            return
        try:
            await client.zrem(REGISTRY_KEY, self._me)
        except Exception:  # it goes stale on its own within seconds
            logger.warning("Could not leave the process registry", exc_info=True)
        await client.aclose()

    async def _beat(self) -> None:
        now = time.time()
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.zadd(REGISTRY_KEY, {self._me: now})
            pipe.zremrangebyscore(REGISTRY_KEY, "-inf", now - STALE_AFTER_SECONDS)
            pipe.zrange(REGISTRY_KEY, 0, -1)
            results = await pipe.execute()
        self._take_share([m.decode() for m in results[2]], self._me)


class Pool(NamedTuple):
    """Which model's pool a request waits in, and that model's ready backends."""

    key: str  # the served model's name
    ready: int
    capacities: tuple[int, ...]  # max_concurrency of those that declare one
    backends: tuple[str, ...]


def _first_pool(routes: RouterSnapshot, names: tuple[str, ...]) -> Pool | None:
    """The pool of the first of `names` with a ready backend (the router's
    order: the name, its alias target, then the fallback chains')."""
    for name in names:
        model_routes = routes.routes.get(name)
        if model_routes is not None and model_routes.routable:
            return _pool_from(
                name, model_routes.routable, routes.policy.waits_at_backends
            )
    return None


def _pool_from(model: str, routable: Sequence[PreparedTarget], waits: int = 0) -> Pool:
    """The pool of `model` served by `routable`; `waits`: requests that may
    wait per backend beyond its max_concurrency (the fleet strategy's lines,
    ``Policy.waits_at_backends``), which its band lets through to wait there."""
    return Pool(
        key=model,
        ready=len(routable),
        capacities=tuple(
            target.capacity + waits
            for target in routable
            if target.capacity != UNLIMITED
        ),
        backends=tuple(target.backend_name for target in routable),
    )


def _flow_full(capacity: int) -> FlowQueueFull:
    return FlowQueueFull(
        f"{capacity} requests of this flow are waiting in the gateway, its flow "
        "capacity; retry later."
    )


def _flow(flow_key: FlowKey, key_prefix: str, model: str) -> str:
    if flow_key is FlowKey.KEY:
        return key_prefix
    if flow_key is FlowKey.MODEL:
        return model
    return f"{key_prefix}|{model}"


def _parse_criticality(value: bytes) -> Criticality:
    try:
        return Criticality.parse(value.decode("latin-1"))
    except ValueError as error:
        raise BadAdmissionHeader("X-Nexus-Criticality", str(error)) from None


def _parse_deadline(value: bytes, unit: float, *, strict: bool) -> float | None:
    """Seconds from now, or None for an SDK value we cannot read."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        if strict:
            raise BadAdmissionHeader(
                "X-Nexus-Deadline-Ms",
                "X-Nexus-Deadline-Ms must be a positive number of milliseconds.",
            )
        return None
    return min(number / unit, MAX_DEADLINE_SECONDS)


def _max_tokens(payload: Mapping[str, Any]) -> int | None:
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = payload.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return min(value, 10_000_000)
    return None


def _share_from_environment() -> tuple[int, int]:
    try:
        processes = max(1, int(os.environ.get(PROCESSES_ENV, "1")))
        index = min(max(0, int(os.environ.get(INDEX_ENV, "0"))), processes - 1)
    except ValueError:
        return 0, 1
    return index, processes
