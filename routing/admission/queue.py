"""FairRequestQueue: weighted fair queuing across flows, in criticality levels.

Each criticality level is a self-clocked fair queue: a request of flow *f*
gets the virtual finish time ``max(V, f.last_finish) + size / weight`` and
the level serves the smallest first, setting its virtual time ``V`` to it.
A flow's finish times only grow, so requests of one flow leave in arrival
order (FIFO) whatever their sizes. Levels share the dispatches by their
``shares`` (stride scheduling over the requests' sizes: critical 70, default
25, sheddable 5 by default), so a sustained critical flood cannot starve the
other levels; a level whose share is 0 is served only when no level with a
share waits (100 / 0 / 0 is strict priority). A level that starts waiting
gets no credit for the time it was empty.

Bounds: ``flow_capacity`` requests per flow (over all levels) and
``total_capacity`` in all; non-critical requests may fill only
``total_capacity - critical_reserved``. When a request finds no room, it takes
the place of a less critical one (sheddable before default; critical is never
taken): the newest request of the flow least recently preempted in that level.

Removal (client gone, TTL, deadline, preemption) is O(1) or O(log n): every
waiting request is in its flow's ordered dict, in one arrival-ordered dict
(the TTL is the same for all, so the oldest expires first) and lazily in its
level's heap and the deadline heap, which are compacted when mostly stale.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from routing.admission.errors import FlowQueueFull, QueueFull
from routing.admission.vocabulary import Criticality, Outcome

# Preemption history kept for flows no longer waiting (bounded).
PREEMPTION_MEMORY = 4096
_LEVELS_SERVED = (Criticality.CRITICAL, Criticality.DEFAULT, Criticality.SHEDDABLE)
DEFAULT_SHARES = MappingProxyType(
    {Criticality.CRITICAL: 70, Criticality.DEFAULT: 25, Criticality.SHEDDABLE: 5}
)
_LEVELS_SHED = (Criticality.SHEDDABLE, Criticality.DEFAULT)


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place in admission control, from arrival to release.

    ``outcome`` is None while the request waits. ``on_done`` is called once
    when a waiting request is decided (dispatched, expired, preempted, ...),
    from whatever call decided it.
    """

    flow: str
    criticality: Criticality = Criticality.DEFAULT
    size: float = 1.0
    weight: float = 1.0
    model: str = ""
    deadline: float | None = None  # on the controller's clock
    on_done: Callable[[Ticket], None] | None = None
    arrived: float = 0.0
    outcome: Outcome | None = None
    decided_at: float | None = None
    released: bool = False
    pool: Any = field(default=None, repr=False)  # the controller's Pool
    pool_key: str = ""  # which pool (the served model), and its ready backends
    ready: int = 0
    capacities: tuple[int, ...] = ()
    backends: tuple[str, ...] = ()  # the ready backends' names (for the views)
    seq: int = 0
    vfinish: float = 0.0
    queued: bool = False
    held: Any = None  # its gateway-wide queue places (gateway.admission_places)
    # A batch job's line: waits in the pool's batch lane, behind every
    # interactive request (routing.admission.batch_lane).
    batch: bool = False


class _Flow:
    __slots__ = ("entries", "key", "last_finish")

    def __init__(self, key: str) -> None:
        self.key = key
        self.entries: dict[Ticket, None] = {}  # arrival (= finish time) order
        self.last_finish = 0.0


class _Level:
    __slots__ = ("flows", "heap", "live", "passed", "share", "vtime")

    def __init__(self, share: int) -> None:
        self.flows: dict[str, _Flow] = {}
        self.live = 0
        self.heap: list[tuple[float, int, Ticket]] = []
        self.vtime = 0.0
        self.share = share
        self.passed = 0.0  # the level's stride-scheduling pass


class FairRequestQueue:
    """Requests waiting for a pool's backends, served fairly by flow."""

    def __init__(
        self,
        *,
        total_capacity: int = 1000,
        flow_capacity: int = 100,
        critical_reserved: int = 0,
        ttl: float = 30.0,
        shares: Mapping[Criticality, int] = DEFAULT_SHARES,
    ) -> None:
        self.total_capacity = total_capacity
        self.flow_capacity = flow_capacity
        self.critical_reserved = critical_reserved
        self.ttl = ttl
        self._levels = {level: _Level(shares[level]) for level in Criticality}
        self._pass_clock = 0.0  # the pass of the level served last
        self._by_arrival: dict[Ticket, None] = {}
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self._per_flow: dict[str, int] = {}
        self._non_critical = 0
        self._seq = 0
        self._preemptions = 0
        self._preempted_at: dict[tuple[Criticality, str], int] = {}

    def __len__(self) -> int:
        return len(self._by_arrival)

    def set_limits(
        self,
        *,
        total_capacity: int,
        flow_capacity: int,
        critical_reserved: int,
        ttl: float,
        shares: Mapping[Criticality, int] = DEFAULT_SHARES,
    ) -> None:
        """Apply new limits to future arrivals (waiting requests stay)."""
        self.total_capacity = total_capacity
        self.flow_capacity = flow_capacity
        self.critical_reserved = critical_reserved
        self.ttl = ttl
        for level, share in shares.items():
            self._levels[level].share = share

    def flow_lengths(self) -> dict[str, int]:
        """Requests waiting per flow (all levels together)."""
        return dict(self._per_flow)

    @property
    def active_flows(self) -> int:
        """Flows with at least one request waiting."""
        return len(self._per_flow)

    def waiting(self) -> Iterator[Ticket]:
        """The waiting requests, oldest first."""
        return iter(list(self._by_arrival))

    def push(self, ticket: Ticket, now: float) -> list[Ticket]:
        """Queue `ticket`; return the requests it preempted (already removed).

        Raises FlowQueueFull when its flow is at flow_capacity, QueueFull when
        the queue (or its non-critical part) is full and nothing less critical
        can make room.
        """
        flow_count = self._per_flow.get(ticket.flow, 0)
        if flow_count >= self.flow_capacity:
            raise FlowQueueFull(
                f"Too many requests of this flow are waiting ({flow_count}, the "
                f"flow capacity); retry later."
            )
        need = self._places_needed(ticket.criticality)
        if need and self._count_below(ticket.criticality) < need:
            raise QueueFull(
                f"The admission queue is full ({len(self)} requests waiting); "
                "retry later."
            )
        preempted: list[Ticket] = []
        for _ in range(need):
            victim = self._victim_below(ticket.criticality)
            assert victim is not None  # counted above
            self._remove(victim)
            preempted.append(victim)
        self._insert(ticket, now)
        return preempted

    def pop(self) -> Ticket | None:
        """Remove and return the next request to serve (None if none waits)."""
        chosen: _Level | None = None
        first: _Level | None = None
        for criticality in _LEVELS_SERVED:
            level = self._levels[criticality]
            if not level.live:
                continue
            if first is None:
                first = level
            if level.share and (chosen is None or level.passed < chosen.passed):
                chosen = level
        if chosen is None:
            chosen = first
            if chosen is None:
                return None
        heap = chosen.heap
        while heap:
            vfinish, _, ticket = heapq.heappop(heap)
            if ticket.queued and ticket.vfinish == vfinish:
                chosen.vtime = max(chosen.vtime, vfinish)
                if chosen.share:
                    self._pass_clock = chosen.passed
                    chosen.passed += max(ticket.size, 1.0) / chosen.share
                self._remove(ticket)
                return ticket
        return None  # not reached: a live level has a live heap entry

    def waiting_at(self, criticality: Criticality) -> int:
        """Requests waiting at one criticality level."""
        return self._levels[criticality].live

    def shed(self, criticality: Criticality) -> Ticket | None:
        """Take out the request of level `criticality` a full queue gives up
        first (see ``push``); None when that level has none waiting."""
        victim = self._victim_in(criticality)
        if victim is not None:
            self._remove(victim)
        return victim

    def remove(self, ticket: Ticket) -> bool:
        """Take a waiting request out (cancelled); False if it was not waiting."""
        if not ticket.queued:
            return False
        self._remove(ticket)
        return True

    def expire(self, now: float) -> list[tuple[Ticket, Outcome]]:
        """Remove the requests past the TTL or their deadline, with the reason."""
        expired: list[tuple[Ticket, Outcome]] = []
        limit = now - self.ttl
        while self._by_arrival:
            oldest = next(iter(self._by_arrival))
            if oldest.arrived > limit:
                break
            self._remove(oldest)
            expired.append((oldest, Outcome.EXPIRED))
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, _, ticket = heapq.heappop(deadlines)
            if ticket.queued:
                self._remove(ticket)
                expired.append((ticket, Outcome.DEADLINE))
        return expired

    def next_expiry(self) -> float | None:
        """The clock time at which the next request expires, if any waits."""
        deadlines = self._deadlines
        while deadlines and not deadlines[0][2].queued:
            heapq.heappop(deadlines)
        soonest = deadlines[0][0] if deadlines else None
        if self._by_arrival:
            ttl_end = next(iter(self._by_arrival)).arrived + self.ttl
            soonest = ttl_end if soonest is None else min(soonest, ttl_end)
        return soonest

    # Internals -------------------------------------------------------------

    def _places_needed(self, criticality: Criticality) -> int:
        need = len(self._by_arrival) - self.total_capacity + 1
        if criticality is not Criticality.CRITICAL:
            room = self.total_capacity - self.critical_reserved
            need = max(need, self._non_critical - room + 1)
        return max(need, 0)

    def _count_below(self, criticality: Criticality) -> int:
        return sum(
            self._levels[level].live for level in _LEVELS_SHED if level < criticality
        )

    def _victim_below(self, criticality: Criticality) -> Ticket | None:
        for level_name in _LEVELS_SHED:
            if level_name >= criticality:
                return None
            victim = self._victim_in(level_name)
            if victim is not None:
                return victim
        return None

    def _victim_in(self, level_name: Criticality) -> Ticket | None:
        """The newest request of the flow least recently preempted in the level."""
        flows = self._levels[level_name].flows
        if not flows:
            return None
        history = self._preempted_at
        flow = min(
            flows.values(),
            key=lambda f: (
                history.get((level_name, f.key), -1),
                -len(f.entries),
                f.key,
            ),
        )
        victim = next(reversed(flow.entries))
        self._preemptions += 1
        key = (level_name, flow.key)
        history.pop(key, None)
        history[key] = self._preemptions
        if len(history) > PREEMPTION_MEMORY:
            del history[next(iter(history))]
        return victim

    def _insert(self, ticket: Ticket, now: float) -> None:
        level = self._levels[ticket.criticality]
        if not level.live:
            # No credit for the time it was empty: it starts level with the
            # level served last.
            level.passed = max(level.passed, self._pass_clock)
        flow = level.flows.get(ticket.flow)
        if flow is None:
            flow = level.flows[ticket.flow] = _Flow(ticket.flow)
        self._seq += 1
        ticket.seq = self._seq
        ticket.arrived = now
        ticket.vfinish = (
            max(level.vtime, flow.last_finish) + ticket.size / ticket.weight
        )
        flow.last_finish = ticket.vfinish
        flow.entries[ticket] = None
        self._by_arrival[ticket] = None
        ticket.queued = True
        level.live += 1
        heapq.heappush(level.heap, (ticket.vfinish, ticket.seq, ticket))
        if ticket.deadline is not None:
            heapq.heappush(self._deadlines, (ticket.deadline, ticket.seq, ticket))
        self._per_flow[ticket.flow] = self._per_flow.get(ticket.flow, 0) + 1
        if ticket.criticality is not Criticality.CRITICAL:
            self._non_critical += 1

    def _remove(self, ticket: Ticket) -> None:
        ticket.queued = False
        level = self._levels[ticket.criticality]
        flow = level.flows[ticket.flow]
        del flow.entries[ticket]
        if not flow.entries:
            del level.flows[ticket.flow]
        del self._by_arrival[ticket]
        count = self._per_flow[ticket.flow] - 1
        if count:
            self._per_flow[ticket.flow] = count
        else:
            del self._per_flow[ticket.flow]
        if ticket.criticality is not Criticality.CRITICAL:
            self._non_critical -= 1
        level.live -= 1
        if len(level.heap) > 2 * level.live + 64:
            level.heap = [entry for entry in level.heap if entry[2].queued]
            heapq.heapify(level.heap)
        if len(self._deadlines) > 2 * len(self._by_arrival) + 64:
            self._deadlines = [e for e in self._deadlines if e[2].queued]
            heapq.heapify(self._deadlines)
