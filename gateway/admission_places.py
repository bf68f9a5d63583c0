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

from typing import TYPE_CHECKING, Protocol

from routing.admission.settings import AdmissionSettings

if TYPE_CHECKING:
    from usage.limits.redis_limiter import RedisLimiter

# Why a request found no place.
QUEUE_FULL = "queue"  # total_capacity (or its non-critical part) waits
FLOW_FULL = "flow"  # flow_capacity of its flow waits

# The counts a waiting request takes a place in: its flow's, the total, and
# the critical or the non-critical one. In Redis each is a sorted set of
# leases under one cluster slot (the script takes places in several at once).
_PREFIX = "nx:{admission}:waiting"
KEY_PATTERN = "nx:{admission}:*"  # every one of them (SCAN's pattern)
_UNCHECKED = -1  # a count a place is taken in without a limit


def _counts(
    flow: str, critical: bool, settings: AdmissionSettings, over: bool
) -> list[tuple[str, int]]:
    """The counts (names) a request of `flow` takes a place in, each with its
    limit, the flow's first; `over` (critical only): the total unchecked."""
    capacity = settings.total_capacity
    level = (
        ("critical", capacity)
        if critical
        else ("non-critical", capacity - settings.critical_reserved)
    )
    return [
        (f"flow:{flow}", settings.flow_capacity),
        ("total", _UNCHECKED if over else capacity),
        level,
    ]


def _why(full: int) -> str:
    """Why there is no place, from the index of the first full count."""
    return FLOW_FULL if full == 0 else QUEUE_FULL


# The places one waiting request holds (given back once): the names of its
# counts here, its leases in Redis.
Held = list[str]


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
        self.counts: dict[str, int] = {}  # only those above 0

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
        wanted = _counts(flow, critical, settings, over)
        counts = self.counts
        for index, (name, limit) in enumerate(wanted):
            if limit != _UNCHECKED and counts.get(name, 0) >= limit:
                return _why(index)
        for name, _ in wanted:
            counts[name] = counts.get(name, 0) + 1
        return [name for name, _ in wanted]

    def give_back(self, held: Held) -> None:
        counts = self.counts
        for name in held:
            left = counts.pop(name) - 1
            if left:
                counts[name] = left


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
        wanted = _counts(flow, critical, settings, over)
        leases, full = await self.limiter.acquire_places(
            [f"{_PREFIX}:{name}" for name, _ in wanted],
            [limit for _, limit in wanted],
        )
        return _why(full - 1) if full else leases

    def give_back(self, held: Held) -> None:
        if held:
            self.limiter.release_places(held)
