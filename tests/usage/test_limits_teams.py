"""Team limits on top of each key's own, in one admission: both limiters.

The local limiter runs in every mode; the Redis one where there is a Redis
(production mode), with two limiters standing for two serving processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from django.conf import settings

from tests.usage.test_limits_redis import (  # noqa: F401 (redis_url: a fixture)
    count_round_trips,
    redis_url,
)
from usage.limits.limiter import (
    BUDGET,
    CONCURRENCY,
    REQUESTS,
    Decision,
    LocalLimiter,
)
from usage.limits.policy import KeyPolicy, TeamPolicy, period_id
from usage.limits.redis_keys import budget_key
from usage.limits.redis_limiter import RedisLimiter

TEAM = TeamPolicy("team:901", name="research", budget_period="day", budget_tokens=1000)


def member(prefix: str, team: TeamPolicy = TEAM, **limits: Any) -> KeyPolicy:
    return KeyPolicy(prefix, team=team, **limits)


@pytest.fixture(params=["local", "redis"])
def limiters(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """Two limiters sharing counters: one local limiter twice (one process),
    or two Redis limiters (two processes)."""
    if request.param == "local":
        local = LocalLimiter()
        return local, local
    if not settings.REDIS_URL:
        pytest.skip("the embedded default has no Redis of its own here")
    url = request.getfixturevalue("redis_url")
    return RedisLimiter(url), RedisLimiter(url)


def run(main: Callable[[], Awaitable[Any]], *limiters: Any) -> Any:
    async def wrapped() -> Any:
        for limiter in set(limiters):
            limiter.start()
        try:
            return await main()
        finally:
            for limiter in set(limiters):
                await limiter.stop()
                if isinstance(limiter, RedisLimiter):
                    await limiter._writes.flush()

    return asyncio.run(wrapped())


async def flush(*limiters: Any) -> None:
    for limiter in limiters:
        if isinstance(limiter, RedisLimiter):
            await limiter._writes.flush()


def test_two_keys_of_a_team_exhaust_the_team_pool_exactly(limiters) -> None:
    one, two = limiters
    a, b = member("nx-teama1"), member("nx-teamb1")

    async def main() -> list[Decision]:
        decisions = []
        for index in range(14):
            limiter, policy = (one, a) if index % 2 else (two, b)
            decision = await limiter.admit(policy, 100, 0)
            decisions.append(decision)
            if decision.ticket is not None:
                limiter.settle(decision.ticket, 100, 0)
                await flush(limiter)
        return decisions

    decisions = run(main, one, two)

    admitted = [d for d in decisions if d.allowed]
    assert len(admitted) == 10  # 10 x 100 tokens: the team's 1,000
    refused = decisions[10:]
    assert all(d.reason == BUDGET and d.scope == "team" for d in refused)
    assert refused[0].retry_after > 0  # until the UTC day ends


def test_a_keys_own_cap_holds_inside_the_team_pool(limiters) -> None:
    one, two = limiters
    capped = member("nx-capped1", budget_period="day", budget_tokens=300)
    free = member("nx-free1")

    async def main() -> tuple[list[Decision], list[Decision]]:
        mine, theirs = [], []
        for _ in range(5):
            decision = await one.admit(capped, 100, 0)
            mine.append(decision)
            if decision.ticket is not None:
                one.settle(decision.ticket, 100, 0)
                await flush(one)
        for _ in range(9):
            decision = await two.admit(free, 100, 0)
            theirs.append(decision)
            if decision.ticket is not None:
                two.settle(decision.ticket, 100, 0)
                await flush(two)
        return mine, theirs

    mine, theirs = run(main, one, two)

    assert [d.allowed for d in mine] == [True] * 3 + [False] * 2
    assert mine[3].scope == "key" and mine[3].reason == BUDGET
    # The rest of the pool (700) is the other key's, and no more.
    assert sum(d.allowed for d in theirs) == 7
    assert theirs[7].scope == "team"


def test_team_concurrency_counts_every_keys_requests_in_flight(limiters) -> None:
    one, two = limiters
    team = TeamPolicy("team:902", max_concurrency=2)
    a, b = member("nx-conca1", team), member("nx-concb1", team)

    async def main() -> tuple[Decision, ...]:
        first = await one.admit(a, 0, 0)
        second = await two.admit(b, 0, 0)
        third = await one.admit(b, 0, 0)
        one.settle(first.ticket, 0, 0)
        await flush(one)
        fourth = await two.admit(a, 0, 0)
        return first, second, third, fourth

    first, second, third, fourth = run(main, one, two)

    assert first.allowed and second.allowed and fourth.allowed
    assert third.reason == CONCURRENCY and third.scope == "team"


def test_a_team_refusal_takes_nothing_from_the_key(limiters) -> None:
    """All or nothing: the key's RPM is not spent on requests its team refused."""
    one, _ = limiters
    team = TeamPolicy("team:903", rpm=2)
    key = member("nx-atomic1", team, rpm=3)
    other = member("nx-atomic2", team)

    async def main() -> list[Decision]:
        out = [await one.admit(other, 0, 0), await one.admit(other, 0, 0)]
        out += [await one.admit(key, 0, 0) for _ in range(3)]
        return out

    decisions = run(main, one)

    assert [d.allowed for d in decisions] == [True, True, False, False, False]
    refused = decisions[2]
    assert refused.reason == REQUESTS and refused.scope == "team"
    # The headers show the tighter bucket: the team's, empty.
    assert dict(refused.headers)[b"x-ratelimit-remaining-requests"] == b"0"
    assert dict(refused.headers)[b"x-ratelimit-limit-requests"] == b"2"


def test_a_stream_is_covered_by_the_team_budget_until_it_runs_out(limiters) -> None:
    one, two = limiters
    team = TeamPolicy("team:904", budget_period="day", budget_tokens=500)
    a, b = member("nx-covera1", team), member("nx-coverb1", team)

    async def main() -> tuple[bool, bool, Decision]:
        running = await one.admit(a, 100, 0)
        other = await two.admit(b, 300, 0)  # holds 300 of the pool
        grown = await one.cover(running.ticket, (150, 0), (200, 0))
        cut = await one.cover(running.ticket, (250, 0), (300, 0))  # 200 at most
        one.settle(running.ticket, 250, 0)
        two.settle(other.ticket, 300, 0)
        await flush(one, two)
        after = await one.admit(a, 1, 0)
        return grown, cut, after

    grown, cut, after = run(main, one, two)

    assert grown and not cut
    assert after.reason == BUDGET and after.scope == "team"  # 550 of 500 used


@pytest.mark.skipif(not settings.REDIS_URL, reason="the embedded default has no Redis")
def test_a_team_keys_admission_and_settle_cost_one_round_trip(
    redis_url: str,  # noqa: F811 (the fixture imported above)
) -> None:
    """Key and team together in one script; their settles written unanswered."""
    limiter = RedisLimiter(redis_url)
    team = TeamPolicy("team:905", rpm=1000, budget_period="day", budget_tokens=10**9)
    key = member("nx-trips1", team, rpm=1000, budget_period="day", budget_tokens=10**9)

    async def main() -> tuple[int, int]:
        await limiter._renewing.stop()  # its first renewal is a round trip too
        trips = count_round_trips(limiter)
        for _ in range(20):
            decision = await limiter.admit(key, 10, 0)
            limiter.settle(decision.ticket, 10, 0)
        await limiter._writes.flush()
        return trips[0], int(limiter._holds[budget_key("team:905", _today())][0])

    trips, team_held = run(main, limiter)

    assert trips == 20  # one per admission: none for a settle, none for the team
    assert team_held == 0  # every hold settled


def _today() -> str:
    return period_id("day", time.time())
