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

from usage.limits.policy import KeyPolicy, period_end, period_id

WINDOW = 60.0  # seconds: RPM and TPM are per minute

# Why admission said no (the gateway's error and the metrics' label).
REQUESTS = "requests"
TOKENS = "tokens"
CONCURRENCY = "concurrency"
BUDGET = "budget"
UNAVAILABLE = "unavailable"


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


def budget_retry_after(policy: KeyPolicy, now: float) -> float:
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
        now = self.clock()
        prefix = policy.prefix
        ticket = Ticket(policy)
        at_limit = policy.max_concurrency is not None and (
            self._concurrent.get(prefix, 0) >= policy.max_concurrency
        )
        if at_limit:
            return Decision(None, CONCURRENCY, 1.0)
        requests = tokens_state = None
        rpm_tat = tpm_tat = 0.0
        if policy.rpm is not None:
            ok, rpm_tat, requests, wait = gcra(
                self._rpm.get(prefix, 0.0), now, policy.rpm, 1
            )
            if not ok:
                return _denied(REQUESTS, wait, requests, None)
        if policy.tpm is not None:
            charge = min(tokens, policy.tpm)
            ok, tpm_tat, tokens_state, wait = gcra(
                self._tpm.get(prefix, 0.0), now, policy.tpm, charge
            )
            if not ok:
                return _denied(TOKENS, wait, requests, tokens_state)
            ticket.charged_tokens = charge
        budget: list[int] | None = None
        if policy.has_budget:
            ticket.period = period_id(policy.budget_period, now)
            budget = self._budgets.setdefault((prefix, ticket.period), [0, 0, 0, 0])
            ok_t, hold_t = hold_for(policy.budget_tokens, budget[0], budget[2], tokens)
            ok_n, hold_n = hold_for(policy.budget_nanos, budget[1], budget[3], nanos)
            if not (ok_t and ok_n):
                return _denied(
                    BUDGET,
                    budget_retry_after(policy, now),
                    requests,
                    tokens_state,
                )
            ticket.held_tokens, ticket.held_nanos = hold_t, hold_n
            budget[2] += hold_t
            budget[3] += hold_n
        # Every check passed: take it all.
        if policy.max_concurrency is not None:
            self._concurrent[prefix] = self._concurrent.get(prefix, 0) + 1
            ticket.lease = "local"
        if policy.rpm is not None:
            self._rpm[prefix] = rpm_tat
        if policy.tpm is not None:
            self._tpm[prefix] = tpm_tat
        return Decision(
            ticket,
            requests=requests,
            tokens=tokens_state,
            headers=rate_headers(requests, tokens_state),
        )

    async def cover(
        self, ticket: Ticket, used: tuple[int, int], want: tuple[int, int]
    ) -> bool:
        """Grow a running request's hold towards `want` (tokens, nanos); return
        whether the budget covers what it `used` so far."""
        policy = ticket.policy
        budget = self._budgets.get((policy.prefix, ticket.period))
        if budget is None or ticket.unchecked:
            return True
        held = [ticket.held_tokens, ticket.held_nanos]
        ok = True
        for index, limit in ((0, policy.budget_tokens), (1, policy.budget_nanos)):
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
        policy = ticket.policy
        prefix = policy.prefix
        if ticket.unchecked:
            return
        if ticket.lease:
            self._concurrent[prefix] = max(self._concurrent.get(prefix, 0) - 1, 0)
        if policy.tpm is not None and tokens != ticket.charged_tokens:
            now = self.clock()
            tat = self._tpm.get(prefix, now)
            tat += (tokens - ticket.charged_tokens) * WINDOW / policy.tpm
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
