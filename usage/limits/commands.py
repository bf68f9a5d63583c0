"""A client key's commands to the Redis limiter, encoded once, and its reserve."""

from __future__ import annotations

from collections.abc import Callable

from usage.limits.limiter import WINDOW, Decision, RateState, Ticket, rate_headers
from usage.limits.policy import KeyPolicy, LimitLayer, TeamPolicy
from usage.limits.redis_keys import LEASE_SECONDS, budget_key, budget_ttl, counter_key
from usage.limits.reserve import Reserve
from usage.limits.resp import encode_parts
from usage.limits.scripts import SETTLE, limit_arg


def _layer_keys(layer: LimitLayer, period: str) -> tuple[str, str, str, str]:
    prefix = layer.prefix
    return (
        counter_key(prefix, "rpm"),
        counter_key(prefix, "tpm"),
        counter_key(prefix, "concurrency"),
        budget_key(prefix, period or "none"),
    )


def _settle_command(layer: LimitLayer, keys: tuple[str, ...], process: str) -> bytes:
    # 3 + 3 keys + 3 static + 6 per-request arguments. EVAL, not EVALSHA:
    # nobody awaits a settle, and a NOSCRIPT answer (a Redis that lost its
    # scripts) would be sent again behind the commands written after it, such
    # as the next admission that needs the slot it frees.
    return b"*15\r\n" + encode_parts(
        (
            "EVAL",
            SETTLE,
            3,
            *keys[1:],
            layer.tpm or 0,
            process,
            budget_ttl(layer.budget_period),
        )
    )


def _layer_args(layer: LimitLayer) -> tuple[int, ...]:
    return (
        layer.rpm or 0,
        layer.tpm or 0,
        layer.max_concurrency or 0,
        limit_arg(layer.budget_tokens),
        limit_arg(layer.budget_nanos),
        budget_ttl(layer.budget_period),
    )


class TeamCommands:
    """The team part of a team key's commands: its counters, holds and settle."""

    __slots__ = ("concurrency_key", "holds", "keys", "period", "settle")

    def __init__(
        self,
        team: TeamPolicy,
        period: str,
        process: str,
        holds_of: Callable[[str, int], list[int]],
    ) -> None:
        self.period = period
        self.keys = _layer_keys(team, period)
        self.concurrency_key = self.keys[2]
        self.holds = (
            holds_of(self.keys[3], budget_ttl(team.budget_period)) if period else None
        )
        self.settle = _settle_command(team, self.keys, process)


class KeyCommands:
    """One key's admission and settle commands, encoded once (per policy and
    budget period) but for their per-request arguments, and its reserve."""

    __slots__ = (
        "admit",
        "busy_until",
        "concurrency_key",
        "ends",
        "holds",
        "in_flight",
        "keys",
        "period",
        "rates",
        "reserve",
        "reserving",
        "settle",
        "team",
        "unsettled",
    )

    def __init__(
        self,
        policy: KeyPolicy,
        period: str,
        ends: float,
        process: str,
        admit_sha: str,
        holds_of: Callable[[str, int], list[int]],
        team: TeamCommands | None = None,
    ) -> None:
        self.keys = _layer_keys(policy, period)
        budget = self.keys[3]
        ttl = budget_ttl(policy.budget_period)
        self.period = period
        self.ends = ends  # Unix time a budget period (the key's or team's) ends
        self.concurrency_key = self.keys[2]
        # A key with team limits: admitted by the layered script (the key's
        # and the team's limits together), never from a reserve.
        self.team = team
        self.rates = (policy.rpm or 0, policy.tpm or 0)
        # What this process holds against the budget, shared by every
        # KeyCommands of the same budget counter (see RedisLimiter.renew).
        self.holds = holds_of(budget, ttl) if period else None
        self.reserve: Reserve | None = None
        # An admission asking for a reserve is out: the key's requests that
        # overlap it ask for none (one reserve at a time, see RedisLimiter._grant).
        self.reserving = False
        self.busy_until = 0.0  # monotonic: a request before then takes a reserve
        self.in_flight = 0  # requests of the key holding a slot here
        # Settles summed, not written yet: TPM delta, held tokens, held nanos,
        # used tokens, used nanos (see RedisLimiter.settle).
        self.unsettled: list[int] | None = None
        self.settle = _settle_command(policy, self.keys, process)
        if team is not None:
            assert policy.team is not None
            # 3 + 8 keys + 2 + 12 static + 4 per-request arguments.
            self.admit = b"*29\r\n" + encode_parts(
                (
                    "EVALSHA",
                    admit_sha,
                    8,
                    *self.keys,
                    *team.keys,
                    LEASE_SECONDS * 1000,
                    process,
                    *_layer_args(policy),
                    *_layer_args(policy.team),
                )
            )
            return
        # 3 + 4 keys + 8 static + 5 per-request arguments.
        self.admit = b"*20\r\n" + encode_parts(
            (
                "EVALSHA",
                admit_sha,
                4,
                *self.keys,
                policy.rpm or 0,
                policy.tpm or 0,
                policy.max_concurrency or 0,
                limit_arg(policy.budget_tokens),
                limit_arg(policy.budget_nanos),
                LEASE_SECONDS * 1000,
                process,
                ttl,
            )
        )

    def admit_reserved(
        self,
        policy: KeyPolicy,
        tokens: int,
        nanos: int,
        mono: float,
    ) -> Decision | None:
        """Admit from the key's reserve, or None if it cannot cover this request."""
        reserve = self.reserve
        assert reserve is not None
        if mono >= reserve.expires:
            return None
        charge = held_t = held_n = 0
        if policy.rpm is not None and reserve.requests < 1:
            return None
        if policy.tpm is not None:
            charge = min(tokens, policy.tpm)
            if reserve.tokens < charge:
                return None
        if policy.budget_tokens is not None:
            if reserve.budget_tokens < tokens:
                return None
            held_t = tokens
        if policy.budget_nanos is not None:
            if reserve.budget_nanos < nanos:
                return None
            held_n = nanos
        lease = ""
        if policy.max_concurrency is not None:
            if not reserve.slots:
                return None
            lease = reserve.slots.pop()
            self.in_flight += 1
        reserve.requests -= 1
        reserve.tokens -= charge
        reserve.budget_tokens -= held_t
        reserve.budget_nanos -= held_n
        # The headers: the buckets as this process sees them, its own use
        # since the reserve counted (GCRA: each request moves the bucket's
        # full-again instant on by its share of the minute).
        rr = tr = -1
        rreset = treset = 0.0
        if policy.rpm is not None:
            reserve.requests_reset = (
                max(reserve.requests_reset, mono) + WINDOW / policy.rpm
            )
            rreset = reserve.requests_reset - mono
            rr = max(int((WINDOW - rreset) * policy.rpm / WINDOW + 1e-9), 0)
        if policy.tpm is not None:
            reserve.tokens_reset = (
                max(reserve.tokens_reset, mono) + charge * WINDOW / policy.tpm
            )
            treset = reserve.tokens_reset - mono
            tr = max(int((WINDOW - treset) * policy.tpm / WINDOW + 1e-9), 0)
        headers, requests, token_state = key_rate_headers(
            policy, rr, rreset, tr, treset
        )
        ticket = Ticket(
            policy,
            period=self.period,
            lease=lease,
            charged_tokens=charge,
            held_tokens=held_t,
            held_nanos=held_n,
            handle=self,
        )
        return Decision(ticket, "", 0.0, requests, token_state, headers)


def key_rate_headers(
    policy: KeyPolicy, rr: int, rreset: float, tr: int, treset: float
) -> tuple[list[tuple[bytes, bytes]], RateState | None, RateState | None]:
    """The rate-limit headers and figures of an admission (-1: no such limit)."""
    requests = tokens = None
    if policy.rpm is not None and rr >= 0:
        requests = RateState(policy.rpm, rr, rreset)
    if policy.tpm is not None and tr >= 0:
        tokens = RateState(policy.tpm, tr, treset)
    return rate_headers(requests, tokens), requests, tokens
