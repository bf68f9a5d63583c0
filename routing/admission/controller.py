"""The admission controller: stock, the hysteresis band, dispatch and release.

A *pool* holds the requests for one served model: one stock, one band and
one fair queue (Nexus's backends are not interchangeable, so the gateway-wide
stock of the seed would let a busy model hold back an idle one). Its key does
not depend on which backends are ready: when that set changes the band is
recomputed and the waiting requests go first (``resize()``), so a backend
that turns ready takes the queue before new arrivals, and nothing already
waiting is overtaken. The stock is the number of requests of the pool this
process let through and has not seen end; the band is the policy's
per-backend bounds times the pool's ready backends, this process's share of
it (``AdmissionSettings.band``).

- ``admit()``: straight through (bypass) while nothing waits and the stock is
  below the band's upper limit, else into the queue (which may refuse, or
  preempt something less critical); the stock counts it when it goes through.
- ``release()``: the one way out of a ticket that was let through (completed
  in any way: success, error, client gone, retries, a stream cut half-way) or
  still waits (cancelled): the stock returns to exactly 0 at rest.
- A release wakes the queue at once (``pump()``: send waiting requests while
  the stock is below the lower limit); no poller, the async glue adds a
  safety timer.

Pure Python with an injected clock: the proxy's async glue
(``gateway.admission``) turns ``Ticket.on_done`` into a future.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from routing.admission.batch_lane import BatchLane, has_batch_room
from routing.admission.errors import (
    AdmissionError,
    ClientCancelled,
    DeadlineExceeded,
    Preempted,
    QueueTTLExpired,
)
from routing.admission.queue import FairRequestQueue, Ticket
from routing.admission.settings import AdmissionSettings, Band
from routing.admission.vocabulary import Criticality, Outcome

Clock = Callable[[], float]


@dataclass(eq=False, slots=True)
class Pool:
    """The stock, band and queue of one served model."""

    key: str
    ready: int
    band: Band
    queue: FairRequestQueue
    capacities: tuple[int, ...] = ()  # max_concurrency of ready backends that say
    backends: tuple[str, ...] = ()  # the ready backends' names (for the views)
    stock: int = 0
    stock_tokens: float = 0.0  # the sizes of the requests in the stock
    stock_by_model: dict[str, int] = field(default_factory=dict)
    queueing: bool = False  # enqueue mode (False: bypass mode)
    mode_changes: int = 0
    batch: BatchLane = field(default_factory=BatchLane)  # batch lines waiting
    batch_stock: int = 0  # of the stock: batch lines


@dataclass(slots=True)
class Counts:
    """What happened in this process since it started (for the metrics)."""

    arrived: int = 0
    bypassed: int = 0
    enqueued: int = 0
    dispatched: int = 0
    expired: int = 0
    deadline: int = 0
    cancelled: int = 0
    preempted: int = 0
    rejected: int = 0
    dequeue_attempts: int = 0
    dequeue_successes: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # at the door, by code
    preempted_by: dict[str, int] = field(default_factory=dict)  # by criticality

    @property
    def events(self) -> int:
        """Moves whenever a queue's length or a refusal count changed."""
        return (
            self.arrived
            + self.dispatched
            + self.expired
            + self.deadline
            + self.cancelled
            + self.preempted
        )


class AdmissionController:
    """Admission control of one serving process (see the module docstring)."""

    def __init__(
        self,
        settings: AdmissionSettings | None = None,
        *,
        clock: Clock,
        index: int = 0,
        processes: int = 1,
    ) -> None:
        self.settings = settings or AdmissionSettings()
        self.clock = clock
        self.index = index
        self.processes = processes
        self.pools: dict[str, Pool] = {}
        self.counts = Counts()

    # Configuration ---------------------------------------------------------

    def configure(self, settings: AdmissionSettings) -> None:
        """Use new settings: new limits and bands, then send what now fits."""
        self.settings = settings
        for pool in self.pools.values():
            self._apply_limits(pool.queue)
            pool.band = self._band(pool)
        self.pump_all()

    def set_share(self, index: int, processes: int) -> None:
        """This process is `index` of `processes` serving processes now."""
        if (index, processes) == (self.index, self.processes):
            return
        self.index, self.processes = index, processes
        for pool in self.pools.values():
            pool.band = self._band(pool)
        self.pump_all()

    def forget_idle_pools(self) -> None:
        """Drop pools with nothing in flight or waiting (configuration changed)."""
        self.pools = {
            key: pool
            for key, pool in self.pools.items()
            if pool.stock or len(pool.queue) or len(pool.batch)
        }

    # Requests --------------------------------------------------------------

    def admit(
        self,
        ticket: Ticket,
        pool_key: str,
        ready_backends: int,
        capacities: tuple[int, ...] = (),
        backends: tuple[str, ...] = (),
    ) -> Ticket:
        """Let `ticket` through or queue it; return it.

        On return ``ticket.outcome`` is BYPASSED or DISPATCHED (go ahead) or
        None (wait for ``on_done``). Raises QueueFull or FlowQueueFull when the
        queue refuses it, DeadlineExceeded when it would wait but its deadline
        has passed.
        """
        counts = self.counts
        counts.arrived += 1
        pool = self._pool(pool_key, ready_backends, capacities, backends)
        ticket.pool = pool
        queue = pool.queue
        now = self.clock()
        if ticket.batch:
            return self._admit_batch(pool, ticket, now)
        if _can_bypass(pool):
            if pool.queueing:
                pool.queueing = False
                pool.mode_changes += 1
            counts.bypassed += 1
            self._let_through(pool, ticket, Outcome.BYPASSED, now)
            return ticket
        try:
            if ticket.deadline is not None and ticket.deadline <= now:
                raise DeadlineExceeded(_deadline_message(0.0))
            preempted = queue.push(ticket, now)
        except AdmissionError as error:
            self.count_refusal(error.code)
            raise
        counts.enqueued += 1
        if not pool.queueing:
            pool.queueing = True
            pool.mode_changes += 1
        for victim in preempted:
            self._preempted(victim, now)
        self.pump(pool)
        return ticket

    def count_refusal(self, code: str) -> None:
        """Count a request refused at the door (here, or by the gateway-wide
        queue places before it reached a pool)."""
        counts = self.counts
        counts.rejected += 1
        counts.refused[code] = counts.refused.get(code, 0) + 1

    def bypasses(
        self,
        pool_key: str,
        ready_backends: int,
        capacities: tuple[int, ...] = (),
        backends: tuple[str, ...] = (),
    ) -> bool:
        """Whether a request for pool `pool_key` would go straight through now
        (``admit()`` would not queue it)."""
        return _can_bypass(self._pool(pool_key, ready_backends, capacities, backends))

    def preempt_below(self, criticality: Criticality) -> bool:
        """Shed one waiting request less critical than `criticality`, from
        whichever pool has the most of the least critical level (the gateway's
        queue is full: a more critical request takes its place). False when
        none waits."""
        for level in (Criticality.SHEDDABLE, Criticality.DEFAULT):
            if level >= criticality:
                break
            pool = max(
                self.pools.values(),
                key=lambda p: p.queue.waiting_at(level),
                default=None,
            )
            if pool is None or not pool.queue.waiting_at(level):
                continue
            victim = pool.queue.shed(level)
            if victim is not None:
                self._preempted(victim, self.clock())
                self._note_if_drained(pool)
                return True
        return False

    def release(self, ticket: Ticket) -> None:
        """End `ticket`: completed if let through, cancelled if waiting.

        Safe to call more than once and for tickets that were refused,
        expired or preempted (then it does nothing).
        """
        if ticket.released:
            return
        ticket.released = True
        pool: Pool | None = ticket.pool
        if pool is None:
            return
        outcome = ticket.outcome
        if outcome is None:
            if ticket.batch and pool.batch.remove(ticket):
                self.counts.cancelled += 1
                self._decide(ticket, Outcome.CANCELLED, self.clock())
            elif pool.queue.remove(ticket):
                self.counts.cancelled += 1
                self._decide(ticket, Outcome.CANCELLED, self.clock())
                self._note_if_drained(pool)
            return
        if outcome is Outcome.BYPASSED or outcome is Outcome.DISPATCHED:
            pool.stock -= 1
            if ticket.batch:
                pool.batch_stock -= 1
            pool.stock_tokens = pool.stock_tokens - ticket.size if pool.stock else 0.0
            by_model = pool.stock_by_model
            left = by_model[ticket.model] - 1
            if left:
                by_model[ticket.model] = left
            else:
                del by_model[ticket.model]
            self.pump(pool)

    def resize(
        self,
        key: str,
        ready_backends: int,
        capacities: tuple[int, ...] = (),
        backends: tuple[str, ...] = (),
    ) -> None:
        """The ready backends of pool `key` changed: a new band, and what now
        fits of the waiting requests goes at once, before any new arrival."""
        pool = self.pools.get(key)
        if pool is not None:
            self._pool(key, ready_backends, capacities, backends)

    def open_pool(self, key: str) -> None:
        """Let everything waiting in pool `key` through (its model has no
        ready backend left: the router answers them, by a fallback or its
        own error, rather than leaving them to wait out the TTL)."""
        pool = self.pools.get(key)
        if pool is not None:
            self._open(pool, self.clock())

    def pump(self, pool: Pool) -> None:
        """Send waiting requests while the pool's stock is below the lower limit."""
        queue = pool.queue
        counts = self.counts
        limit = pool.band.dispatch_limit
        token_limit = pool.band.token_dispatch_limit
        now = -1.0
        while pool.stock < limit and pool.stock_tokens < token_limit and len(queue):
            counts.dequeue_attempts += 1
            ticket = queue.pop()
            if ticket is None:
                break
            counts.dequeue_successes += 1
            counts.dispatched += 1
            if now < 0:
                now = self.clock()
            self._let_through(pool, ticket, Outcome.DISPATCHED, now)
            self._call(ticket)
        self._note_if_drained(pool)
        if pool.batch and not len(queue):
            self._pump_batch(pool)

    def pump_all(self) -> None:
        """Pump every pool (the safety timer, and after any limit changed)."""
        for pool in list(self.pools.values()):
            self.pump(pool)

    def open_all(self) -> None:
        """Let every waiting request through (fail-open when dequeueing broke)."""
        now = self.clock()
        for pool in list(self.pools.values()):
            self._open(pool, now)

    def expire(self) -> float | None:
        """Refuse requests past the TTL or their deadline; return the next expiry."""
        now = self.clock()
        soonest: float | None = None
        for pool in list(self.pools.values()):
            for ticket, outcome in pool.queue.expire(now):
                if outcome is Outcome.EXPIRED:
                    self.counts.expired += 1
                else:
                    self.counts.deadline += 1
                self._decide(ticket, outcome, now)
            self._note_if_drained(pool)
            ttl = self.settings.queue_ttl
            for ticket in pool.batch.expire(now, ttl):
                self.counts.expired += 1
                self._decide(ticket, Outcome.EXPIRED, now)
            for next_expiry in (pool.queue.next_expiry(), pool.batch.next_expiry(ttl)):
                if next_expiry is not None and (
                    soonest is None or next_expiry < soonest
                ):
                    soonest = next_expiry
        return soonest

    # Views -----------------------------------------------------------------

    @property
    def stock(self) -> int:
        """Requests let through and not yet released, over all pools."""
        return sum(pool.stock for pool in self.pools.values())

    @property
    def waiting(self) -> int:
        """Requests waiting, over all pools (batch lines included)."""
        return sum(len(pool.queue) + len(pool.batch) for pool in self.pools.values())

    @property
    def batch_waiting(self) -> int:
        """Batch lines waiting, over all pools."""
        return sum(len(pool.batch) for pool in self.pools.values())

    @property
    def batch_running(self) -> int:
        """Batch lines let through and not yet released, over all pools."""
        return sum(pool.batch_stock for pool in self.pools.values())

    def waiting_tickets(self) -> Iterable[Ticket]:
        for pool in self.pools.values():
            yield from pool.queue.waiting()
            yield from pool.batch.waiting()

    # Internals -------------------------------------------------------------

    def _pool(
        self,
        key: str,
        ready: int,
        capacities: tuple[int, ...],
        backends: tuple[str, ...] = (),
    ) -> Pool:
        pool = self.pools.get(key)
        if pool is None:
            queue = FairRequestQueue()
            self._apply_limits(queue)
            pool = self.pools[key] = Pool(
                key=key,
                ready=ready,
                band=self.settings.band(ready, self.index, self.processes, capacities),
                queue=queue,
                capacities=capacities,
                backends=backends,
            )
        elif pool.ready != ready or pool.capacities != capacities:
            pool.ready, pool.capacities, pool.backends = ready, capacities, backends
            pool.band = self._band(pool)
            self.pump(pool)
        elif backends and pool.backends != backends:
            pool.backends = backends
        return pool

    def _open(self, pool: Pool, now: float) -> None:
        while True:
            ticket = pool.queue.pop() or pool.batch.pop()
            if ticket is None:
                break
            self.counts.dispatched += 1
            self._let_through(pool, ticket, Outcome.DISPATCHED, now)
            self._call(ticket)
        self._note_if_drained(pool)

    def _admit_batch(self, pool: Pool, ticket: Ticket, now: float) -> Ticket:
        """A batch line goes only when nothing else waits and there is room
        below the batch limit; else it waits in the pool's batch lane."""
        if not len(pool.queue) and not pool.batch and self._has_batch_room(pool):
            self.counts.bypassed += 1
            self._let_through(pool, ticket, Outcome.BYPASSED, now)
            return ticket
        if ticket.deadline is not None and ticket.deadline <= now:
            self.count_refusal(DeadlineExceeded.code)
            raise DeadlineExceeded(_deadline_message(0.0))
        self.counts.enqueued += 1
        pool.batch.push(ticket, now)
        return ticket

    def _pump_batch(self, pool: Pool) -> None:
        """Send waiting batch lines while the pool has batch room."""
        lane, counts = pool.batch, self.counts
        now = -1.0
        while lane and self._has_batch_room(pool):
            ticket = lane.pop()
            if ticket is None:
                break
            counts.dispatched += 1
            if now < 0:
                now = self.clock()
            self._let_through(pool, ticket, Outcome.DISPATCHED, now)
            self._call(ticket)

    def _has_batch_room(self, pool: Pool) -> bool:
        return has_batch_room(
            pool.band, self.settings.batch_headroom, pool.stock, pool.stock_tokens
        )

    def _band(self, pool: Pool) -> Band:
        return self.settings.band(
            pool.ready, self.index, self.processes, pool.capacities
        )

    def _apply_limits(self, queue: FairRequestQueue) -> None:
        settings = self.settings
        queue.set_limits(
            total_capacity=settings.total_capacity,
            flow_capacity=settings.flow_capacity,
            critical_reserved=settings.critical_reserved,
            ttl=settings.queue_ttl,
            shares=settings.shares,
        )

    def _let_through(
        self, pool: Pool, ticket: Ticket, outcome: Outcome, now: float
    ) -> None:
        pool.stock += 1
        if ticket.batch:
            pool.batch_stock += 1
        pool.stock_tokens += ticket.size
        by_model = pool.stock_by_model
        by_model[ticket.model] = by_model.get(ticket.model, 0) + 1
        ticket.outcome = outcome
        ticket.decided_at = now

    def _preempted(self, victim: Ticket, now: float) -> None:
        counts = self.counts
        counts.preempted += 1
        level = victim.criticality.label
        counts.preempted_by[level] = counts.preempted_by.get(level, 0) + 1
        self._decide(victim, Outcome.PREEMPTED, now)

    def _decide(self, ticket: Ticket, outcome: Outcome, now: float) -> None:
        ticket.outcome = outcome
        ticket.decided_at = now
        self._call(ticket)

    @staticmethod
    def _call(ticket: Ticket) -> None:
        if ticket.on_done is not None:
            ticket.on_done(ticket)

    @staticmethod
    def _note_if_drained(pool: Pool) -> None:
        # Back to bypass mode only once the queue is empty: the hysteresis.
        if pool.queueing and _can_bypass(pool):
            pool.queueing = False
            pool.mode_changes += 1


def _can_bypass(pool: Pool) -> bool:
    """Nothing waits and the stock is below the band's upper limit."""
    band = pool.band
    return (
        not len(pool.queue)
        and pool.stock < band.bypass_limit
        and pool.stock_tokens < band.token_bypass_limit
    )


def _deadline_message(waited: float) -> str:
    return (
        "The request's deadline passed while it waited for a backend "
        f"({waited:.1f} s in the admission queue)."
    )


def error_of(ticket: Ticket) -> AdmissionError | None:
    """The error a client is told for a ticket decided without going through."""
    outcome = ticket.outcome
    waited = (ticket.decided_at or ticket.arrived) - ticket.arrived
    if outcome is Outcome.EXPIRED:
        return QueueTTLExpired(
            f"The request waited {waited:.1f} s for a backend, the longest this "
            "gateway queues a request; the backends are busy, retry later."
        )
    if outcome is Outcome.DEADLINE:
        return DeadlineExceeded(_deadline_message(waited))
    if outcome is Outcome.PREEMPTED:
        return Preempted(
            f"The request was shed after waiting {waited:.1f} s: the queue was "
            f"full and a more critical request took its place (criticality "
            f"'{ticket.criticality.label}'). Retry later."
        )
    if outcome is Outcome.CANCELLED:
        return ClientCancelled("The client closed the request while it waited.")
    return None
