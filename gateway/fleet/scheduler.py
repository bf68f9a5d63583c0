"""The fleet scheduler of one serving process: the async glue around the core.

The gateway owns one ``FleetScheduler``. The proxy asks it, per request:

1. ``hold_route``: when the router finds no backend for the requested model
   (and ``hold_seconds`` > 0), wait for a snapshot where one can serve it,
   re-routing on every snapshot installed and every couple of seconds, then
   route through the fallback chain as usual;
2. ``after_decision``: record that the winner now has the model loaded (and
   which idle models it unloads for it, if memory is short), so the next
   decisions follow the load; start a warm-up of the model on the runner-up
   when the winner is getting deep (off the request path, through the
   gateway's HTTP session; never one that would unload a model there, nor
   on a node paused for cold loads);
3. ``take_slot``: under the fleet strategy, wait in the winner's line when it
   has no free slot (bounded length and time; a request may be moved to a hot
   backend meanwhile by the rebalancer);
4. ``finished``: a request on a backend ended; hand its slot to the next
   waiter (called by the proxy's forward for every backend it counted).

The lines live in this process's memory, so each serving process schedules
and rebalances its own waiters; the rebalance task runs in the process too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict, TypeVar

import aiohttp

from gateway.fleet.errors import QueueFull, QueueTimeout
from gateway.fleet.prewarm import PrewarmBook
from gateway.fleet.queues import FleetQueues, Waiter, has_free_slot
from gateway.fleet.rebalance import LineLoad, Move, Opening, plan_rebalance
from gateway.fleet.settings import (
    HOLD_RECHECK_SECONDS,
    MAX_HELD,
    PREWARM_MEMORY_SECONDS,
    FleetSettings,
)
from nexus_lib.service import periodic
from routing.core import BackendSpec, LiveStats, Route, RouterSnapshot, Target
from routing.core.capacity import (
    OOM_SCAN_BYTES,
    OutOfMemory,
    cold_load_pause,
    note_out_of_memory,
    parse_out_of_memory,
)
from routing.core.decision import Decision, Outcome, Role, Via
from routing.core.fleet import (
    evictions_for,
    learned_concurrency,
    observe_load,
    thermal_state,
)
from routing.core.types import UNLIMITED
from routing.core.vocabulary import Thermal

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

_PRIMARY_ROLES = (Role.REQUESTED, Role.ALIAS)
# Where a failed warm-up's out-of-memory error goes: (backend, model, error).
OutOfMemoryNote = Callable[[BackendSpec, str, OutOfMemory], object]
T = TypeVar("T")


RECENT_PREWARMS = 20


class LineDict(TypedDict):
    backend: str
    model: str
    waiting: int


class PrewarmDict(TypedDict):
    backend: str
    model: str
    outcome: str
    at: float  # epoch seconds


class PausedDict(TypedDict):
    backend: str
    reason: str


class FleetStateDict(TypedDict):
    """What the dashboard shows of one process's fleet scheduler."""

    enabled: bool
    lines: list[LineDict]
    # Backends taking no new cold loads, as this process sees them, and why.
    paused: list[PausedDict]
    waiting: int
    held: int
    moved_total: int
    prewarm_total: int
    prewarms: list[PrewarmDict]


class Placement(NamedTuple):
    """Where a request that waited runs, and what to retry after.

    ``lease``: the gateway-wide slot lease handed over by the request that
    ended (see ``FleetScheduler.finished``), for ``target``'s backend.
    """

    target: Target
    retry_targets: tuple[Target, ...]
    lease: str | None = None


class FleetScheduler:
    """Queues, warm-ups, rebalancing and held requests of one process.

    A service (nexus_lib.service): ``start()`` runs the periodic rebalance,
    ``stop()`` ends it and any warm-up under way.
    """

    name = "fleet"

    def __init__(
        self,
        stats: LiveStats,
        metrics: GatewayMetrics,
        *,
        session: Callable[[], aiohttp.ClientSession],
        routes: Callable[[], RouterSnapshot | None],
        release_lease: Callable[[str, str], None] = lambda backend, lease: None,
        out_of_memory: OutOfMemoryNote | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stats = stats
        # A warm-up that failed for want of memory (the gateway's error
        # cache notes it in every serving process).
        self._out_of_memory: OutOfMemoryNote = out_of_memory or (
            lambda backend, model, oom: note_out_of_memory(stats, backend, model, oom)
        )
        self._release_lease = release_lease
        self.metrics = metrics
        self._session = session
        self._routes = routes
        self._clock = clock
        self.queues = FleetQueues()
        self.prewarm = PrewarmBook(clock, PREWARM_MEMORY_SECONDS)
        self.held = 0
        self.moved_total = 0
        self.prewarm_total = 0
        # The last warm-ups, for the dashboard: (backend, model, outcome, at).
        self.recent_prewarms: deque[tuple[str, str, str, float]] = deque(
            maxlen=RECENT_PREWARMS
        )
        self._settings: tuple[object, FleetSettings] | None = None
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # warm-ups under way
        self._rebalancing = periodic(
            "fleet-rebalance",
            self._rebalance_interval,
            self._rebalance_now,
            error="Rebalancing the fleet's queues failed",
            log=logger.exception,
        )

    # Lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Start the rebalance task on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._rebalancing.start()

    async def stop(self) -> None:
        """Stop the rebalance task and any warm-up under way."""
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(self._rebalancing.stop(), *tasks, return_exceptions=True)
        self._loop = None

    def _spawn(
        self, loop: asyncio.AbstractEventLoop, coroutine: Any, name: str
    ) -> None:
        task = loop.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def settings_for(self, routes: RouterSnapshot) -> FleetSettings:
        """The fleet settings of `routes`' policy (read once per snapshot)."""
        cached = self._settings
        if cached is not None and cached[0] is routes.policy:
            return cached[1]
        settings = FleetSettings.from_policy(routes.policy)
        self._settings = (routes.policy, settings)
        return settings

    def snapshot_installed(self) -> None:
        """Wake held requests: a new snapshot may serve their model.

        Called by the snapshot holder, on the loop or from the thread that
        built the first snapshot.
        """
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake_held()
        else:
            loop.call_soon_threadsafe(self._wake_held)

    def _wake_held(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # Slots and lines ------------------------------------------------------------

    def _model_capacity(self, target: Target) -> int:
        """The model's slots on its backend: the operator's max_concurrency,
        else what the node's slots or free memory allow (learned_concurrency),
        else no limit of its own."""
        limit = target.model.max_concurrency
        if limit is None or limit < 1:
            routes = self._routes()
            if routes is None:
                return UNLIMITED
            stats = self.stats
            limit = learned_concurrency(
                target.backend,
                target.model,
                stats,
                routes.policy.fleet,
                stats.wall_clock(),
            )
        return limit if limit is not None and limit > 0 else UNLIMITED

    def _can_take(self, target: Target) -> bool:
        backend, model = target.backend.name, target.model.name
        queues, stats = self.queues, self.stats
        return has_free_slot(
            stats.in_flight(backend), queues.reserved(backend), target.backend.capacity
        ) and has_free_slot(
            stats.in_flight_by_model.get((backend, model), 0),
            queues.reserved_for(backend, model),
            self._model_capacity(target),
        )

    def depth(self, backend: str, model: str) -> int:
        """In flight + waiting for `model` on `backend` in this process."""
        return self.stats.in_flight_by_model.get(
            (backend, model), 0
        ) + self.queues.waiting(backend, model)

    async def take_slot(
        self, route: Route, routes: RouterSnapshot
    ) -> Route | Placement:
        """Return where to run the request once a slot is free for it.

        Outside the fleet strategy, or with a free slot and nobody waiting on
        the backend, that is at once `route`. Otherwise the request waits in
        its line; it gets the winner's next free slot, or a slot on another
        backend where the model is hot (moved by the rebalancer). Raises
        QueueFull or QueueTimeout; a cancelled wait leaves the line at once.
        """
        placed = await self.place(route.target, route.retry_targets, routes)
        return route if placed is None else placed

    async def place(
        self, target: Target, retry_targets: tuple[Target, ...], routes: RouterSnapshot
    ) -> Placement | None:
        """``take_slot`` for a request sent to `target` (then `retry_targets`)
        without a route of its own (an ensemble's step): None when it may go
        at once, else where it runs once its line let it through."""
        settings = self.settings_for(routes)
        backend, model = target.backend.name, target.model.name
        if not settings.enabled:
            return None
        if not self.queues.waiting_on(backend) and self._can_take(target):
            return None
        loop = asyncio.get_running_loop()
        waiter = Waiter(backend, model, self._clock(), loop.create_future())
        if not self.queues.join(waiter, settings.queue_length):
            self.metrics.fleet_queue_refusals.labels("queue_full").inc()
            raise QueueFull(
                f"The queue for model '{model}' on backend '{backend}' is full "
                f"({settings.queue_length} waiting). Retry shortly.",
                retry_after=max(1, round(settings.queue_timeout_seconds / 10)),
            )
        self._note_waiting(backend, model, +1)
        self._grant(target.backend.name, routes)
        handle: asyncio.Future[Target] = waiter.handle
        placed: Target | None = None
        try:
            async with asyncio.timeout(settings.queue_timeout_seconds):
                placed = await handle
        except TimeoutError:
            self.metrics.fleet_queue_refusals.labels("queue_timeout").inc()
            raise QueueTimeout(
                f"The request waited {settings.queue_timeout_seconds:g} s for a "
                f"free slot for model '{model}' on backend '{backend}'. Retry "
                "shortly.",
                retry_after=max(1, round(settings.queue_timeout_seconds / 10)),
            ) from None
        finally:
            if placed is None:  # timed out, or the client left
                self._abandon(waiter, routes)
        self.metrics.fleet_queue_wait.observe(self._clock() - waiter.joined_at)
        self.queues.unreserve(placed.backend.name, placed.model.name)
        if placed.backend.name != backend:
            self.note_sent(placed, routes)  # moved by the rebalancer
        if placed.backend.name == backend:
            if waiter.lease is None:
                return None
            return Placement(target, retry_targets, waiter.lease)
        rest = (target, *retry_targets)
        return Placement(
            placed, tuple(t for t in rest if t.backend.name != placed.backend.name)
        )

    def _abandon(self, waiter: Waiter, routes: RouterSnapshot) -> None:
        """Leave the line, or give back a slot granted but not taken."""
        handle: asyncio.Future[Target] = waiter.handle
        if not handle.done() or handle.cancelled():
            handle.cancel()
            if self.queues.leave(waiter):
                self._note_waiting(waiter.backend, waiter.model, -1)
            return
        placed = handle.result()
        name = placed.backend.name
        self.queues.unreserve(name, placed.model.name)
        lease, waiter.lease = waiter.lease, None
        if not self._grant(name, routes, lease) and lease is not None:
            self._release_lease(name, lease)

    def finished(self, backend: str, lease: str | None = None) -> bool:
        """A request on `backend` ended: hand its slot on (no-op if none wait).

        ``lease``: its gateway-wide slot lease (a shared limiter), handed to
        the waiter that gets the slot rather than released and acquired again
        (a release reaches Redis a moment later, so the waiter would find the
        slot still taken). Returns whether it was handed over; if not, the
        caller releases it. Held requests re-route too: a backend at its
        max_concurrency (under the other strategies) may take one now.
        """
        if self.held:
            self._wake_held()
        if not self.queues.waiting_on(backend):
            return False
        routes = self._routes()
        return routes is not None and self._grant(backend, routes, lease)

    def _grant(
        self, backend: str, routes: RouterSnapshot, lease: str | None = None
    ) -> bool:
        """Give every free slot of `backend` to its oldest eligible waiters;
        the first one takes `lease`. Returns whether it did."""
        spec = routes.backend(backend)
        if spec is None:
            return False
        models = {model.name: model for model in spec.models}

        def can_take(model: str) -> bool:
            entry = models.get(model)
            return entry is not None and self._can_take(Target(spec, entry))

        handed = False
        while True:
            waiter = self.queues.pop_next(backend, can_take)
            if waiter is None:
                return handed
            self._note_waiting(backend, waiter.model, -1)
            target = Target(spec, models[waiter.model])
            if self._hand_slot(waiter, target, lease) and lease is not None:
                handed, lease = True, None

    def _hand_slot(
        self, waiter: Waiter, target: Target, lease: str | None = None
    ) -> bool:
        """Give `waiter` a slot on `target` (and `lease`); False if it left."""
        self.queues.reserve(target.backend.name, target.model.name)
        handle: asyncio.Future[Target] = waiter.handle
        if handle.done():  # cancelled meanwhile: the slot goes on
            self.queues.unreserve(target.backend.name, target.model.name)
            return False
        waiter.lease = lease
        handle.set_result(target)
        return True

    def _note_waiting(self, backend: str, model: str, change: int) -> None:
        """Tell the live stats (the queue penalty counts waiters too)."""
        if change > 0:
            self.stats.add_waiting(backend, model)
        else:
            self.stats.remove_waiting(backend, model)

    # Pre-warm -------------------------------------------------------------------

    def is_hot(self, target: Target, routes: RouterSnapshot) -> bool:
        """Whether `target`'s model is loaded on its backend, as far as we know:
        the fleet strategy's thermal signal (the last probe, keep_alive expiry,
        and answers served there lately)."""
        state = thermal_state(
            target.backend.name,
            target.model,
            self.stats,
            routes.policy.fleet,
            self.stats.wall_clock(),
        )
        return state is Thermal.HOT

    def _evictions(self, target: Target, routes: RouterSnapshot) -> list[str]:
        stats = self.stats
        return evictions_for(
            target.backend, target.model, stats, routes.policy.fleet, stats.wall_clock()
        )

    def note_sent(self, target: Target, routes: RouterSnapshot) -> None:
        """Record what sending a request to `target` does to its memory.

        The backend loads the model for it (hot there from now on) and, when
        it does not fit in free memory, unloads its least recently used idle
        models first: those count as unloaded from now on, so the next
        decisions neither expect them hot nor count their memory.
        """
        backend = target.backend.name
        for victim in self._evictions(target, routes):
            self.stats.mark_evicted(backend, victim)
        self.stats.mark_hot(backend, target.model.name)

    def after_decision(self, route: Route, routes: RouterSnapshot) -> None:
        """Note what the request does to the winner's memory (``note_sent``),
        and warm the model on the runner-up if the winner is getting deep.

        The depth counts the request just routed. Only Ollama backends load a
        model on request; other kinds are left alone.
        """
        settings = self.settings_for(routes)
        if not settings.enabled:
            return
        winner = route.target
        model = winner.model.name
        self.note_sent(winner, routes)
        runner_up = next(
            (
                t
                for t in route.decision.retry_order
                if t.model.name == model and t.backend.name != winner.backend.name
            ),
            None,
        )
        if runner_up is None or runner_up.backend.kind != "ollama":
            return
        depth = self.depth(winner.backend.name, model) + 1
        backend = runner_up.backend.name
        if not self.prewarm.should_warm(
            depth,
            settings.pre_warm_threshold,
            backend,
            model,
            self.is_hot(runner_up, routes),
        ):
            return
        if self._evictions(runner_up, routes):
            return  # a warm-up never unloads a model the backend has loaded
        if cold_load_pause(runner_up.backend, self.stats, self.stats.wall_clock()):
            return  # nor loads one where loads failed for memory
        loop = self._loop
        if loop is None:
            return
        self.prewarm.begin(backend, model)
        self._spawn(loop, self._warm(runner_up), f"fleet-prewarm-{backend}")

    async def _warm(self, target: Target) -> None:
        backend, model = target.backend.name, target.model.name
        outcome = "failed"
        started = time.perf_counter()
        try:
            outcome, body = await self._load(target)
            if outcome == "loaded":
                # A load-only request: its time is the node's load time.
                seconds = time.perf_counter() - started
                observe_load(self.stats, target.backend, target.model, seconds)
            oom = None if outcome == "loaded" else parse_out_of_memory(body)
            if oom is not None:
                self._out_of_memory(target.backend, model, oom)
        except (aiohttp.ClientError, TimeoutError) as error:
            logger.warning("Pre-warming %s on %s failed: %s", model, backend, error)
        finally:
            loaded = outcome == "loaded"
            self.prewarm.finish(backend, model, loaded=loaded)
            if loaded:
                self.stats.mark_hot(backend, model)
            self.metrics.fleet_prewarm.labels(backend, model, outcome).inc()
            self.prewarm_total += 1
            self.recent_prewarms.appendleft((backend, model, outcome, time.time()))

    async def _load(self, target: Target) -> tuple[str, bytes]:
        """Ask an Ollama backend to load the model: a generate without a prompt.

        Returns the outcome and, for a failure, the start of the answer.
        """
        spec = target.backend
        headers = {"content-type": "application/json"}
        if spec.api_key:
            headers["authorization"] = f"Bearer {spec.api_key}"
        url = spec.base_url.removesuffix("/").removesuffix("/v1") + "/api/generate"
        async with asyncio.timeout(spec.request_timeout):
            async with self._session().post(
                url,
                json={"model": target.model.name},
                headers=headers,
                allow_redirects=False,
            ) as response:
                if response.status < 300:
                    await response.read()
                    return "loaded", b""
                return "failed", await response.content.read(OOM_SCAN_BYTES)

    # Rebalance ------------------------------------------------------------------

    def _rebalance_interval(self) -> float:
        """The current policy's interval (read before each wait)."""
        routes = self._routes()
        if routes is None:
            return FleetSettings().rebalance_interval_seconds
        return self.settings_for(routes).rebalance_interval_seconds

    def _rebalance_now(self) -> None:
        routes = self._routes()
        if routes is not None and self.settings_for(routes).enabled:
            self.rebalance(routes)

    def rebalance(self, routes: RouterSnapshot) -> list[Move]:
        """Run one cycle: move waiters from deep lines to hot backends with room."""
        settings = self.settings_for(routes)
        lines = [
            LineLoad(
                backend,
                model,
                self.stats.in_flight_by_model.get((backend, model), 0),
                waiting,
            )
            for backend, model, waiting in self.queues.lines()
        ]
        deep = {
            line.model for line in lines if line.depth > settings.rebalance_threshold
        }
        openings = [o for model in sorted(deep) for o in self._openings(routes, model)]
        moves = plan_rebalance(
            lines,
            openings,
            threshold=settings.rebalance_threshold,
            max_moves=settings.rebalance_max_moves,
        )
        done: list[Move] = []
        for move in moves:
            destination = _target_on(routes, move.destination, move.model)
            taken = self.queues.pop_oldest(move.source, move.model, 1)
            if destination is None or not taken:
                continue
            self._note_waiting(move.source, move.model, -1)
            self._hand_slot(taken[0], destination)
            self.metrics.fleet_rebalanced.labels(
                move.source, move.destination, move.model
            ).inc()
            done.append(move)
            self.moved_total += 1
        return done

    def _openings(self, routes: RouterSnapshot, model: str) -> list[Opening]:
        """Backends where `model` is hot and routable, with their free slots."""
        model_routes = routes.routes.get(model)
        if model_routes is None:
            return []
        openings = []
        for prepared in model_routes.routable:
            target = prepared.target
            name = target.backend.name
            if (
                self.stats.is_circuit_open(name)
                or self.stats.connection_failed_at(name) is not None
                or not self.is_hot(target, routes)
            ):
                continue
            if self.queues.waiting_on(name):
                continue  # its own waiters come first
            free = min(
                _room(
                    self.stats.in_flight(name),
                    self.queues.reserved(name),
                    target.backend.capacity,
                ),
                _room(
                    self.stats.in_flight_by_model.get((name, model), 0),
                    self.queues.reserved_for(name, model),
                    self._model_capacity(target),
                ),
            )
            if free > 0:
                openings.append(Opening(name, model, free))
        return openings

    # Holding queue ----------------------------------------------------------------

    def should_hold(self, decision: object, routes: RouterSnapshot) -> bool:
        """Whether to hold a request whose model has no backend right now.

        True when hold_seconds > 0 and the requested model (or its alias
        target) exists but no backend could take it (not a 404 or a 400), be
        the request refused or sent down its fallback chain.
        """
        if not isinstance(decision, Decision):
            return False
        if self.settings_for(routes).hold_seconds <= 0:
            return False
        if decision.via in (Via.DIRECT, Via.ALIAS) or self.held >= MAX_HELD:
            return False
        primary = [a for a in decision.attempts if a.role in _PRIMARY_ROLES]
        return any(a.outcome == Outcome.NO_HEALTHY_BACKEND for a in primary)

    async def hold(
        self, route_primary: Callable[[RouterSnapshot], T | None]
    ) -> T | None:
        """Wait up to hold_seconds for `route_primary` to find a backend.

        Re-routes on every snapshot installed and every HOLD_RECHECK_SECONDS;
        returns the route found, or None when the time is up.
        """
        routes = self._routes()
        if routes is None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings_for(routes).hold_seconds
        self.held += 1
        self.metrics.fleet_held.set(self.held)
        try:
            while (remaining := deadline - loop.time()) > 0:
                changed = self._changed
                try:
                    async with asyncio.timeout(min(remaining, HOLD_RECHECK_SECONDS)):
                        await changed.wait()
                except TimeoutError:
                    pass
                routes = self._routes()
                route = None if routes is None else route_primary(routes)
                if route is not None:
                    self.metrics.fleet_hold_outcomes.labels("served").inc()
                    return route
            self.metrics.fleet_hold_outcomes.labels("expired").inc()
            return None
        finally:
            self.held -= 1
            self.metrics.fleet_held.set(self.held)

    # Shown on the dashboard -----------------------------------------------------

    def as_dict(self) -> FleetStateDict:
        """The lines, warm-ups, moves and held requests of this process."""
        routes = self._routes()
        return {
            "enabled": routes is not None and self.settings_for(routes).enabled,
            "lines": [
                {"backend": b, "model": m, "waiting": n}
                for b, m, n in sorted(self.queues.lines())
            ],
            "paused": self._paused(routes),
            "waiting": self.queues.total_waiting,
            "held": self.held,
            "moved_total": self.moved_total,
            "prewarm_total": self.prewarm_total,
            "prewarms": [
                {"backend": b, "model": m, "outcome": o, "at": at}
                for b, m, o, at in self.recent_prewarms
            ],
        }

    def cold_load_pause(self, backend_name: str) -> str:
        """Why the backend takes no new cold loads now ("": it does, or this
        process does not route to it)."""
        routes = self._routes()
        backend = None if routes is None else routes.backend(backend_name)
        if backend is None:
            return ""
        return cold_load_pause(backend, self.stats, self.stats.wall_clock())

    def _paused(self, routes: RouterSnapshot | None) -> list[PausedDict]:
        if routes is None:
            return []
        now = self.stats.wall_clock()
        return [
            {"backend": backend.name, "reason": reason}
            for backend in routes.backends
            if (reason := cold_load_pause(backend, self.stats, now))
        ]


def _room(in_flight: int, reserved: int, capacity: int) -> int:
    return max(capacity - in_flight - reserved, 0)


def _target_on(routes: RouterSnapshot, backend: str, model: str) -> Target | None:
    spec = routes.backend(backend)
    if spec is None:
        return None
    entry = next((m for m in spec.models if m.name == model), None)
    return None if entry is None else Target(spec, entry)
