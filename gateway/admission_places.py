"""Queue places: ``total_capacity`` and ``flow_capacity`` for the gateway as a whole.

A request that must wait in admission control's queue takes a place first:
one among all the requests waiting in the gateway (every model's pool, every
serving process: at most ``total_capacity``), one among its flow's (at most
``flow_capacity``) and, unless it is critical, one among the non-critical
ones (at most ``total_capacity - critical_reserved``). It gives them back
when it stops waiting (sent on, expired, preempted, cancelled). A request
that goes straight through (bypass, the common case) takes none and costs
nothing here.

Critical flows have the seed's guaranteed capacity: a critical request is
refused only when ``total_capacity`` critical requests wait, or its flow's
``flow_capacity``. When the gateway's queue is full of others, the caller
first sheds a less critical request waiting in its own process; when there
is none there, the critical request takes a place ``over`` the total (the
others' places then keep every new non-critical arrival out until enough
of them have left).

``SharedPlaces`` keeps the counts in Redis, through the limiter's connection
and leases (one round trip per request that waits; a process killed holding
places loses them when their leases expire, ``LEASE_SECONDS``); while Redis
cannot be reached nothing is counted there and each pool's own bounds in this
process still hold. ``LocalPlaces`` counts in this process (the limiter is
local: one serving process, or processes that share no Redis).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

from routing.admission.settings import AdmissionSettings

if TYPE_CHECKING:
    from usage.limits.redis_limiter import RedisLimiter

# Why a request found no place.
QUEUE_FULL = "queue"  # total_capacity (or its non-critical part) waits
FLOW_FULL = "flow"  # flow_capacity of its flow waits

# One cluster slot for all of them (the script takes places in several at once).
_TOTAL_KEY = "nx:{admission}:waiting"
_NON_CRITICAL_KEY = "nx:{admission}:waiting:non-critical"
_CRITICAL_KEY = "nx:{admission}:waiting:critical"
_UNCHECKED = -1  # a set a place is taken in without a limit
KEY_PATTERN = "nx:{admission}:*"  # every one of them (SCAN's pattern)


def _flow_key(flow: str) -> str:
    return f"nx:{{admission}}:waiting:flow:{flow}"


class Held(NamedTuple):
    """The places one waiting request holds (given back once)."""

    flow: str
    critical: bool
    leases: list[str]


class Places(Protocol):
    """Where queue places are counted (see the module docstring)."""

    shared: bool

    async def take(
        self,
        flow: str,
        critical: bool,
        settings: AdmissionSettings,
        *,
        over: bool = False,
    ) -> Held | str: ...

    def give_back(self, held: Held) -> None: ...


class LocalPlaces:
    """Queue places counted in this process."""

    shared = False

    def __init__(self) -> None:
        self.total = 0
        self.non_critical = 0
        self.critical = 0
        self.flows: dict[str, int] = {}

    async def take(
        self,
        flow: str,
        critical: bool,
        settings: AdmissionSettings,
        *,
        over: bool = False,
    ) -> Held | str:
        """The places of one more waiting request, or why there is none;
        `over` (critical only): past a full total, short of total_capacity
        critical requests."""
        capacity = settings.total_capacity
        if self.flows.get(flow, 0) >= settings.flow_capacity:
            return FLOW_FULL
        if critical:
            if self.critical >= capacity or (not over and self.total >= capacity):
                return QUEUE_FULL
            self.critical += 1
        else:
            if self.total >= capacity or (
                self.non_critical >= capacity - settings.critical_reserved
            ):
                return QUEUE_FULL
            self.non_critical += 1
        self.total += 1
        self.flows[flow] = self.flows.get(flow, 0) + 1
        return Held(flow, critical, [])

    def give_back(self, held: Held) -> None:
        self.total -= 1
        if held.critical:
            self.critical -= 1
        else:
            self.non_critical -= 1
        left = self.flows.pop(held.flow) - 1
        if left:
            self.flows[held.flow] = left


class SharedPlaces:
    """Queue places counted in Redis, for every serving process at once."""

    shared = True

    def __init__(self, limiter: RedisLimiter) -> None:
        self.limiter = limiter

    async def take(
        self,
        flow: str,
        critical: bool,
        settings: AdmissionSettings,
        *,
        over: bool = False,
    ) -> Held | str:
        """The places of one more waiting request, or why there is none
        (`over`: as ``LocalPlaces.take``)."""
        capacity = settings.total_capacity
        keys = [_flow_key(flow), _TOTAL_KEY]
        limits = [settings.flow_capacity, _UNCHECKED if over else capacity]
        if critical:
            keys.append(_CRITICAL_KEY)
            limits.append(capacity)
        else:
            keys.append(_NON_CRITICAL_KEY)
            limits.append(capacity - settings.critical_reserved)
        leases, full = await self.limiter.acquire_places(keys, limits)
        if full:
            return FLOW_FULL if full == 1 else QUEUE_FULL
        return Held(flow, critical, leases)

    def give_back(self, held: Held) -> None:
        if held.leases:
            self.limiter.release_places(held.leases)
