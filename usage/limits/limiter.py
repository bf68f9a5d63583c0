"""Admission against a key's limits and budgets, and the in-process limiter.

A request passes ``admit()`` once, before it is forwarded: it takes a slot of
the key's concurrency, a request and its token estimate from the RPM and TPM
buckets, and holds its estimated tokens and cost against the budget (all or
nothing). A stream that outgrows its hold asks ``cover()`` for more as it goes;
when the budget cannot cover what it has already relayed it is cut. On the way
out ``settle()`` turns the hold into what was really used, gives back the TPM
estimate's difference and frees the slot.

Rates are GCRA buckets (a bucket of N requests or tokens refilled continuously
at N per minute: a burst of up to N, then N a minute; OpenAI's documented
semantics). ``LocalLimiter`` keeps them in this process (the embedded default:
each serving process enforces the limits on its own);
``usage.limits.redis_limiter.RedisLimiter`` keeps them in Redis for the gateway
as a whole. Both do the arithmetic of this module.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from usage.limits.policy import KeyPolicy, LimitLayer, period_end, period_id

WINDOW = 60.0  # seconds: RPM and TPM are per minute

# Why admission said no (the gateway's error and the metrics' label).
REQUESTS = "requests"
TOKENS = "tokens"
CONCURRENCY = "concurrency"
BUDGET = "budget"
UNAVAILABLE = "unavailable"


@dataclass(slots=True)
class TeamTicket:
    """What admission took from the key's team's limits for one request."""

    period: str = ""
    lease: str = ""
    charged_tokens: int = 0
    held_tokens: int = 0
    held_nanos: int = 0


@dataclass(slots=True)
class Ticket:
    """What admission took for one request, given back or settled at its end."""

    policy: KeyPolicy
    period: str = ""
    lease: str = ""  # the concurrency slot, "" when the key has no limit
    charged_tokens: int = 0  # taken from the TPM bucket
    held_tokens: int = 0  # held against the budget
    held_nanos: int = 0
    # Fail-open admission while the limiter was unreachable: nothing was taken.
    unchecked: bool = False
    # The limiter's own data about the admission (the Redis limiter's
    # pre-encoded settle command).
    handle: object = None
    # What was taken from the team's limits (None: the key has no team limits).
    team: TeamTicket | None = None


@dataclass(frozen=True, slots=True)
class RateState:
    """One bucket's figures for the rate-limit headers."""

    limit: int
    remaining: int
    reset: float  # seconds until the bucket is full again


@dataclass(slots=True)
class Decision:
    """The answer of admit(): a ticket, or why not and when to retry."""

    ticket: Ticket | None
    reason: str = ""
    retry_after: float = 0.0
    requests: RateState | None = None
    tokens: RateState | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    # Whose limit refused: the key's own ("key") or its team's ("team").
    scope: str = "key"

    @property
    def allowed(self) -> bool:
        return self.ticket is not None


def gcra(
    tat: float, now: float, limit: int, cost: int
) -> tuple[bool, float, RateState, float]:
    """Take `cost` from a bucket of `limit` per minute whose theoretical arrival
    time is `tat`; return (allowed, new tat, header figures, retry after)."""
    interval = WINDOW / limit
    tat = max(tat, now)
    new_tat = tat + cost * interval
    if new_tat - now > WINDOW + 1e-9:
        remaining = max(int((WINDOW - (tat - now)) / interval + 1e-9), 0)
        return (
            False,
            tat,
            RateState(limit, remaining, tat - now),
            new_tat - now - WINDOW,
        )
    remaining = max(int((WINDOW - (new_tat - now)) / interval + 1e-9), 0)
    return True, new_tat, RateState(limit, remaining, new_tat - now), 0.0


def format_reset(seconds: float) -> bytes:
    """OpenAI's reset format: "20ms", "1s", "6m0s"."""
    if seconds < 1:
        return f"{max(math.ceil(seconds * 1000), 0)}ms".encode()
    whole = math.ceil(seconds)
    if whole < 60:
        return f"{whole}s".encode()
    return f"{whole // 60}m{whole % 60}s".encode()


def rate_headers(
    requests: RateState | None, tokens: RateState | None
) -> list[tuple[bytes, bytes]]:
    headers: list[tuple[bytes, bytes]] = []
    for state, kind in ((requests, b"requests"), (tokens, b"tokens")):
        if state is not None:
            headers += (
                (b"x-ratelimit-limit-" + kind, str(state.limit).encode()),
                (b"x-ratelimit-remaining-" + kind, str(state.remaining).encode()),
                (b"x-ratelimit-reset-" + kind, format_reset(state.reset)),
            )
    return headers


def tighter(a: RateState | None, b: RateState | None) -> RateState | None:
    """The bucket with less left (a key's or its team's), for the headers."""
    if a is None or b is None:
        return a or b
    return b if b.remaining < a.remaining else a


def budget_retry_after(policy: LimitLayer, now: float) -> float:
    end = period_end(policy.budget_period, now)
    return 0.0 if end is None else end - now


def hold_for(
    budget: int | None, spent: int, held: int, estimate: int
) -> tuple[bool, int]:
    """Whether a budget has room left, and how much of `estimate` to hold."""
    if budget is None:
        return True, 0
    left = budget - spent - held
    if left <= 0:
        return False, 0
    return True, min(estimate, left)


class Limiter(Protocol):
    """What the gateway asks; implemented in-process and on Redis.

    A service (nexus_lib.service): started and stopped with the gateway.
    """

    name: str
    shared: bool  # limits hold for the gateway as a whole (all processes)

    def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def admit(self, policy: KeyPolicy, tokens: int, nanos: int) -> Decision: ...
    async def cover(
        self, ticket: Ticket, used: tuple[int, int], want: tuple[int, int]
    ) -> bool: ...
    def settle(self, ticket: Ticket, tokens: int, nanos: int) -> None: ...
    async def acquire_backend(self, backend: str, limit: int) -> str | None: ...
    def release_backend(self, backend: str, lease: str) -> None: ...


# Extra tokens a stream's hold grows by each time it outgrows it, so that a
# long answer asks for more only every so often.
COVER_BLOCK_TOKENS = 256

_lease_ids = itertools.count(1)
_pid = f"{os.getpid()}:"


def _forked() -> None:
    global _pid
    _pid = f"{os.getpid()}:"


os.register_at_fork(after_in_child=_forked)


def new_lease() -> str:
    return f"{_pid}{next(_lease_ids)}"


class LocalLimiter:
    """Limits and budgets kept in this process's memory (the embedded default).

    Budgets start from what ``reconcile()`` last loaded from the usage tables
    (the gateway does that periodically off the request path) plus what this
    process settled since.
    """

    name = "limiter"
    shared = False

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._rpm: dict[str, float] = {}
        self._tpm: dict[str, float] = {}
        self._concurrent: dict[str, int] = {}
        self._backends: dict[str, int] = {}
        # (prefix, period) -> [spent tokens, spent nanos, held tokens, held nanos]
        self._budgets: dict[tuple[str, str], list[int]] = {}

    def start(self) -> None:
        """Nothing to start: the gateway reconciles budgets periodically."""

    async def stop(self) -> None:
        """Nothing to stop."""

    async def admit(self, policy: KeyPolicy, tokens: int, nanos: int) -> Decision:
        return self.admit_now(policy, tokens, nanos)

    def admit_now(self, policy: KeyPolicy, tokens: int, nanos: int) -> Decision:
        """Admit against the key's limits and its team's, all or nothing."""
        now = self.clock()
        key = self._check(policy, tokens, nanos, now)
        if isinstance(key, Decision):
            return key
        team: _Taking | None = None
        if policy.team is not None:
            checked = self._check(policy.team, tokens, nanos, now)
            if isinstance(checked, Decision):
                checked.scope = "team"
                checked.requests = tighter(key.requests, checked.requests)
                checked.tokens = tighter(key.tokens, checked.tokens)
                checked.headers = rate_headers(checked.requests, checked.tokens)
                return checked
            team = checked
        # Every check passed: take it all.
        ticket = Ticket(policy)
        self._take(policy, key, ticket)
        requests, tokens_state = key.requests, key.tokens
        if team is not None and policy.team is not None:
            ticket.team = TeamTicket()
            self._take(policy.team, team, ticket.team)
            requests = tighter(requests, team.requests)
            tokens_state = tighter(tokens_state, team.tokens)
        return Decision(
            ticket,
            requests=requests,
            tokens=tokens_state,
            headers=rate_headers(requests, tokens_state),
        )

    def _check(
        self, layer: LimitLayer, tokens: int, nanos: int, now: float
    ) -> _Taking | Decision:
        """What admitting takes from one layer's limits, or its refusal."""
        prefix = layer.prefix
        taking = _Taking()
        at_limit = layer.max_concurrency is not None and (
            self._concurrent.get(prefix, 0) >= layer.max_concurrency
        )
        if at_limit:
            return Decision(None, CONCURRENCY, 1.0)
        if layer.rpm is not None:
            ok, taking.rpm_tat, taking.requests, wait = gcra(
                self._rpm.get(prefix, 0.0), now, layer.rpm, 1
            )
            if not ok:
                return _denied(REQUESTS, wait, taking.requests, None)
        if layer.tpm is not None:
            taking.charge = min(tokens, layer.tpm)
            ok, taking.tpm_tat, taking.tokens, wait = gcra(
                self._tpm.get(prefix, 0.0), now, layer.tpm, taking.charge
            )
            if not ok:
                return _denied(TOKENS, wait, taking.requests, taking.tokens)
        if layer.has_budget:
            taking.period = period_id(layer.budget_period, now)
            budget = self._budgets.setdefault((prefix, taking.period), [0, 0, 0, 0])
            ok_t, taking.hold_t = hold_for(
                layer.budget_tokens, budget[0], budget[2], tokens
            )
            ok_n, taking.hold_n = hold_for(
                layer.budget_nanos, budget[1], budget[3], nanos
            )
            if not (ok_t and ok_n):
                return _denied(
                    BUDGET,
                    budget_retry_after(layer, now),
                    taking.requests,
                    taking.tokens,
                )
        return taking

    def _take(
        self, layer: LimitLayer, taking: _Taking, ticket: Ticket | TeamTicket
    ) -> None:
        prefix = layer.prefix
        if layer.max_concurrency is not None:
            self._concurrent[prefix] = self._concurrent.get(prefix, 0) + 1
            ticket.lease = "local"
        if layer.rpm is not None:
            self._rpm[prefix] = taking.rpm_tat
        if layer.tpm is not None:
            self._tpm[prefix] = taking.tpm_tat
            ticket.charged_tokens = taking.charge
        if taking.period:
            ticket.period = taking.period
            budget = self._budgets[(prefix, taking.period)]
            budget[2] += taking.hold_t
            budget[3] += taking.hold_n
            ticket.held_tokens, ticket.held_nanos = taking.hold_t, taking.hold_n

    async def cover(
        self, ticket: Ticket, used: tuple[int, int], want: tuple[int, int]
    ) -> bool:
        """Grow a running request's holds (its key's budget and its team's)
        towards `want` (tokens, nanos); return whether the budgets cover what
        it `used` so far."""
        if ticket.unchecked:
            return True
        ok = self._cover(ticket.policy, ticket, used, want)
        team = ticket.team
        if team is not None and ticket.policy.team is not None:
            ok = self._cover(ticket.policy.team, team, used, want) and ok
        return ok

    def _cover(
        self,
        layer: LimitLayer,
        ticket: Ticket | TeamTicket,
        used: tuple[int, int],
        want: tuple[int, int],
    ) -> bool:
        budget = self._budgets.get((layer.prefix, ticket.period))
        if budget is None:
            return True
        held = [ticket.held_tokens, ticket.held_nanos]
        ok = True
        for index, limit in ((0, layer.budget_tokens), (1, layer.budget_nanos)):
            if limit is None or used[index] <= held[index]:
                continue
            available = limit - budget[index] - (budget[2 + index] - held[index])
            new_hold = max(min(max(want[index], used[index]), available), held[index])
            budget[2 + index] += new_hold - held[index]
            held[index] = new_hold
            ok = ok and used[index] <= new_hold
        ticket.held_tokens, ticket.held_nanos = held
        return ok

    def settle(self, ticket: Ticket, tokens: int, nanos: int) -> None:
        if ticket.unchecked:
            return
        policy = ticket.policy
        self._settle(policy, ticket, tokens, nanos)
        if ticket.team is not None and policy.team is not None:
            self._settle(policy.team, ticket.team, tokens, nanos)

    def _settle(
        self, layer: LimitLayer, ticket: Ticket | TeamTicket, tokens: int, nanos: int
    ) -> None:
        prefix = layer.prefix
        if ticket.lease:
            self._concurrent[prefix] = max(self._concurrent.get(prefix, 0) - 1, 0)
        if layer.tpm is not None and tokens != ticket.charged_tokens:
            now = self.clock()
            tat = self._tpm.get(prefix, now)
            tat += (tokens - ticket.charged_tokens) * WINDOW / layer.tpm
            self._tpm[prefix] = max(tat, now)
        if ticket.period:
            budget = self._budgets.setdefault((prefix, ticket.period), [0, 0, 0, 0])
            budget[0] += tokens
            budget[1] += nanos
            budget[2] = max(budget[2] - ticket.held_tokens, 0)
            budget[3] = max(budget[3] - ticket.held_nanos, 0)

    async def acquire_backend(self, backend: str, limit: int) -> str | None:
        # One process: the router's own in-flight count already enforces it.
        return "local"

    def release_backend(self, backend: str, lease: str) -> None:
        pass

    def reconcile(self, spend: Mapping[tuple[str, str], tuple[int, int]]) -> None:
        """Raise spent counters to what the usage tables say, per (prefix, period).

        Never lowers one: spend settled here but not yet in the tables stays.
        """
        for key, (tokens, nanos) in spend.items():
            budget = self._budgets.setdefault(key, [0, 0, 0, 0])
            budget[0] = max(budget[0], tokens)
            budget[1] = max(budget[1], nanos)

    def spent(self, prefix: str, period: str) -> tuple[int, int]:
        budget = self._budgets.get((prefix, period), [0, 0, 0, 0])
        return budget[0], budget[1]


@dataclass(slots=True)
class _Taking:
    """What admitting a request takes from one layer (key or team) of limits."""

    rpm_tat: float = 0.0
    tpm_tat: float = 0.0
    charge: int = 0
    period: str = ""
    hold_t: int = 0
    hold_n: int = 0
    requests: RateState | None = None
    tokens: RateState | None = None


def _denied(
    reason: str,
    retry_after: float,
    requests: RateState | None,
    tokens: RateState | None,
) -> Decision:
    return Decision(
        None,
        reason,
        retry_after,
        requests,
        tokens,
        rate_headers(requests, tokens),
    )
