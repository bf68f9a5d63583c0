"""Keys' limits in process: allow-lists, prices, GCRA buckets, budgets (no I/O)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from nexus_lib.model_patterns import split_patterns
from usage.limits.limiter import (
    BUDGET,
    CONCURRENCY,
    REQUESTS,
    TOKENS,
    LocalLimiter,
    format_reset,
    gcra,
)
from usage.limits.policy import (
    KeyPolicy,
    Price,
    period_end,
    period_id,
    resolve_prices,
)

pytestmark = pytest.mark.mode_independent

NOW = datetime(2026, 11, 24, 13, 30, tzinfo=UTC).timestamp()


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def admit(limiter: LocalLimiter, policy: KeyPolicy, tokens: int = 0, nanos: int = 0):
    return asyncio.run(limiter.admit(policy, tokens, nanos))


def test_allow_list_takes_names_and_glob_patterns() -> None:
    policy = KeyPolicy("nx-a", allowed_models=("gpt-4", "llama3:*"))

    assert policy.allows("gpt-4")
    assert policy.allows("llama3:70b")
    assert not policy.allows("llama3")
    assert not policy.allows("mistral:7b")
    assert policy.allows("mistral:7b", "gpt-4")  # an alias whose target is allowed
    assert KeyPolicy("nx-b").allows("anything")


def test_allow_lists_are_split_and_deduplicated() -> None:
    assert split_patterns(" a, b ,,a,c:*") == ("a", "b", "c:*")


def test_prices_match_exact_names_before_the_longest_pattern() -> None:
    prices = {
        "llama3:*": Price(1, 1),
        "llama3:70b*": Price(2, 2),
        "llama3:70b": Price(3, 3),
    }

    resolved = resolve_prices(prices, ["llama3:70b", "llama3:70b-q4", "llama3:8b", "x"])

    assert resolved == {
        "llama3:70b": Price(3, 3),
        "llama3:70b-q4": Price(2, 2),
        "llama3:8b": Price(1, 1),
    }


def test_a_cost_is_exact_in_nano_usd() -> None:
    # $0.15 / $0.60 per million tokens.
    price = Price(input_nanos=150, output_nanos=600)

    assert price.cost(1_000_000, 1_000_000) == 750_000_000


def test_budget_periods_are_utc_days_and_months() -> None:
    assert period_id("day", NOW) == "d20261124"
    assert period_id("month", NOW) == "m202611"
    assert period_id("total", NOW) == "all"
    assert period_end("day", NOW) == datetime(2026, 11, 25, tzinfo=UTC).timestamp()
    assert period_end("month", NOW) == datetime(2026, 12, 1, tzinfo=UTC).timestamp()
    assert period_end("total", NOW) is None


def test_gcra_allows_a_burst_of_the_limit_then_the_rate() -> None:
    tat, now = 0.0, 1000.0
    allowed = 0
    for _ in range(100):
        ok, new_tat, _, _ = gcra(tat, now, 60, 1)
        if ok:
            allowed += 1
            tat = new_tat
    assert allowed == 60
    ok, _, state, wait = gcra(tat, now, 60, 1)
    assert not ok and wait == pytest.approx(1.0)
    assert state.remaining == 0 and state.reset == pytest.approx(60.0)
    ok, _, state, _ = gcra(tat, now + 1.0, 60, 1)
    assert ok and state.remaining == 0


def test_reset_times_use_openais_format() -> None:
    assert format_reset(0.02) == b"20ms"
    assert format_reset(1.0) == b"1s"
    assert format_reset(360.0) == b"6m0s"


def test_rpm_refuses_past_the_bucket_with_headers_and_retry_after() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock)
    policy = KeyPolicy("nx-a", rpm=3)

    decisions = [admit(limiter, policy) for _ in range(4)]

    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert decisions[3].reason == REQUESTS
    assert decisions[3].retry_after == pytest.approx(20.0)
    headers = dict(decisions[2].headers)
    assert headers[b"x-ratelimit-limit-requests"] == b"3"
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert headers[b"x-ratelimit-reset-requests"] == b"1m0s"
    clock.now += 20
    assert admit(limiter, policy).allowed


def test_tpm_charges_the_estimate_and_settles_to_actual() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock)
    policy = KeyPolicy("nx-a", tpm=1000)

    first = admit(limiter, policy, tokens=800)
    assert first.allowed
    assert not admit(limiter, policy, tokens=300).allowed  # 800 + 300 > 1000
    assert first.ticket is not None
    limiter.settle(first.ticket, 100, 0)  # it really used 100

    second = admit(limiter, policy, tokens=300)
    assert second.allowed
    assert dict(second.headers)[b"x-ratelimit-remaining-tokens"] == b"600"


def test_a_refused_request_takes_nothing() -> None:
    limiter = LocalLimiter(Clock())
    policy = KeyPolicy("nx-a", rpm=10, tpm=100)

    big = admit(limiter, policy, tokens=500)
    assert big.allowed  # a request bigger than the bucket takes the whole bucket
    assert admit(limiter, policy, tokens=1).reason == TOKENS
    # The refusal took no request from the RPM bucket.
    assert (
        dict(admit(limiter, KeyPolicy("nx-a", rpm=10)).headers)[
            b"x-ratelimit-remaining-requests"
        ]
        == b"8"
    )


def test_concurrency_counts_requests_in_flight() -> None:
    limiter = LocalLimiter(Clock())
    policy = KeyPolicy("nx-a", max_concurrency=2)

    one, two = admit(limiter, policy), admit(limiter, policy)
    third = admit(limiter, policy)

    assert one.allowed and two.allowed
    assert third.reason == CONCURRENCY
    assert one.ticket is not None
    limiter.settle(one.ticket, 0, 0)
    assert admit(limiter, policy).allowed


def test_budget_holds_the_estimate_and_refuses_when_used_up() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock)
    policy = KeyPolicy("nx-a", budget_period="day", budget_tokens=1000)

    first = admit(limiter, policy, tokens=700)
    second = admit(limiter, policy, tokens=700)  # only 300 left to hold
    assert first.ticket is not None and second.ticket is not None
    assert (first.ticket.held_tokens, second.ticket.held_tokens) == (700, 300)
    third = admit(limiter, policy, tokens=1)
    assert third.reason == BUDGET
    assert third.retry_after == pytest.approx(10.5 * 3600)  # until UTC midnight

    limiter.settle(first.ticket, 200, 0)
    limiter.settle(second.ticket, 300, 0)
    assert limiter.spent("nx-a", "d20261124") == (500, 0)
    assert admit(limiter, policy, tokens=100).allowed
    clock.now += 11 * 3600  # the next day has a budget of its own
    assert admit(limiter, policy, tokens=1000).allowed


def test_a_money_budget_counts_nano_usd() -> None:
    limiter = LocalLimiter(Clock())
    policy = KeyPolicy("nx-a", budget_period="total", budget_nanos=1_000)

    ticket = admit(limiter, policy, nanos=600).ticket
    assert ticket is not None
    limiter.settle(ticket, 10, 1_000)
    assert admit(limiter, policy, nanos=1).reason == BUDGET


def test_cover_grows_a_hold_until_the_budget_is_gone() -> None:
    limiter = LocalLimiter(Clock())
    policy = KeyPolicy("nx-a", budget_period="month", budget_tokens=100)
    ticket = admit(limiter, policy, tokens=10).ticket
    assert ticket is not None

    assert asyncio.run(limiter.cover(ticket, (50, 0), (60, 0)))
    assert ticket.held_tokens == 60
    assert asyncio.run(limiter.cover(ticket, (100, 0), (200, 0)))
    assert ticket.held_tokens == 100
    assert not asyncio.run(limiter.cover(ticket, (101, 0), (200, 0)))
    limiter.settle(ticket, 101, 0)
    assert limiter.spent("nx-a", "m202611") == (101, 0)
    assert admit(limiter, policy, tokens=1).reason == BUDGET


def test_reconcile_raises_spend_but_never_lowers_it() -> None:
    limiter = LocalLimiter(Clock())
    policy = KeyPolicy("nx-a", budget_period="month", budget_tokens=100)
    ticket = admit(limiter, policy, tokens=10).ticket
    assert ticket is not None
    limiter.settle(ticket, 40, 0)

    limiter.reconcile({("nx-a", "m202611"): (30, 0)})
    assert limiter.spent("nx-a", "m202611") == (40, 0)
    limiter.reconcile({("nx-a", "m202611"): (100, 0)})
    assert admit(limiter, policy, tokens=1).reason == BUDGET
