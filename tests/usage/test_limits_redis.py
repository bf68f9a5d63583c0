"""The Redis limiter (production mode): one counter per key for every process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
from django.conf import settings

from usage.limits.limiter import BUDGET, CONCURRENCY, REQUESTS, TOKENS, UNAVAILABLE
from usage.limits.policy import KeyPolicy, period_id
from usage.limits.shared import RedisLimiter, budget_key

pytestmark = pytest.mark.skipif(
    not settings.REDIS_URL, reason="the embedded default has no Redis"
)


@pytest.fixture
def redis_url() -> Iterator[str]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter("nx:*"):
        client.delete(key)
    yield settings.REDIS_URL
    for key in client.scan_iter("nx:*"):
        client.delete(key)
    client.close()


def run(coroutine_function, *limiters: RedisLimiter):
    """Run a coroutine with the limiters started on its loop, then stop them."""

    async def main():
        for limiter in limiters:
            limiter.start()
        try:
            return await coroutine_function()
        finally:
            for limiter in limiters:
                await limiter.stop()

    return asyncio.run(main())


def test_two_processes_share_one_rpm_bucket(redis_url: str) -> None:
    one, two = RedisLimiter(redis_url), RedisLimiter(redis_url)
    policy = KeyPolicy("nx-shared1", rpm=10)

    async def main():
        decisions = []
        for index in range(14):
            limiter = one if index % 2 else two
            decisions.append(await limiter.admit(policy, 1, 0))
        return decisions

    decisions = run(main, one, two)

    assert sum(d.allowed for d in decisions) == 10
    refused = decisions[-1]
    assert refused.reason == REQUESTS
    assert 5.5 < refused.retry_after <= 6.0
    assert dict(refused.headers)[b"x-ratelimit-remaining-requests"] == b"0"


def test_tpm_settles_to_what_was_used(redis_url: str) -> None:
    limiter = RedisLimiter(redis_url)
    policy = KeyPolicy("nx-tpm1", tpm=1000)

    async def main():
        first = await limiter.admit(policy, 900, 0)
        second = await limiter.admit(policy, 200, 0)
        limiter.settle(first.ticket, 100, 0)
        await limiter._flush_settles()
        third = await limiter.admit(policy, 200, 0)
        return first, second, third

    first, second, third = run(main, limiter)

    assert first.allowed and second.reason == TOKENS and third.allowed
    assert dict(third.headers)[b"x-ratelimit-remaining-tokens"] == b"700"


def test_concurrency_is_shared_and_freed_on_settle(redis_url: str) -> None:
    one, two = RedisLimiter(redis_url), RedisLimiter(redis_url)
    policy = KeyPolicy("nx-conc1", max_concurrency=2)

    async def main():
        a = await one.admit(policy, 0, 0)
        b = await two.admit(policy, 0, 0)
        c = await one.admit(policy, 0, 0)
        one.settle(a.ticket, 0, 0)
        await one._flush_settles()
        d = await two.admit(policy, 0, 0)
        return a, b, c, d

    a, b, c, d = run(main, one, two)

    assert a.allowed and b.allowed and d.allowed
    assert c.reason == CONCURRENCY


def test_budget_holds_spend_and_cover_across_processes(redis_url: str) -> None:
    one, two = RedisLimiter(redis_url), RedisLimiter(redis_url)
    policy = KeyPolicy("nx-budget1", budget_period="day", budget_tokens=1000)

    async def main():
        a = await one.admit(policy, 600, 0)
        b = await two.admit(policy, 600, 0)  # 400 left to hold
        holds = (a.ticket.held_tokens, b.ticket.held_tokens)
        c = await one.admit(policy, 1, 0)
        grown = await one.cover(a.ticket, (700, 0), (800, 0))  # nothing left
        two.settle(b.ticket, 100, 0)
        await two._flush_settles()
        regrown = await one.cover(a.ticket, (700, 0), (800, 0))
        holds += (a.ticket.held_tokens,)
        one.settle(a.ticket, 700, 0)
        await one._flush_settles()
        d = await two.admit(policy, 500, 0)
        return holds, c, grown, regrown, d

    holds, c, grown, regrown, d = run(main, one, two)

    assert holds == (600, 400, 800)
    assert c.reason == BUDGET
    assert not grown and regrown
    assert d.ticket.held_tokens == 200  # 1000 - 100 - 700
    client = redis.Redis.from_url(redis_url)
    stored = client.hgetall(budget_key("nx-budget1", d.ticket.period))
    client.close()
    assert int(stored[b"st"]) == 800
    assert d.ticket.period == period_id("day", time.time())


def test_an_unreachable_redis_fails_open_or_closed_as_configured() -> None:
    errors: list[int] = []
    url = "redis://127.0.0.1:9/0"  # nothing listens on the discard port
    open_limiter = RedisLimiter(url, on_error=lambda: errors.append(1))
    closed = RedisLimiter(url, fail_open=False)
    policy = KeyPolicy("nx-down1", rpm=1)

    async def main():
        return (
            await open_limiter.admit(policy, 1, 0),
            await open_limiter.admit(policy, 1, 0),  # within the back-off: no call
            await closed.admit(policy, 1, 0),
        )

    first, second, third = run(main, open_limiter, closed)

    assert first.allowed and first.ticket.unchecked and second.allowed
    assert errors  # counted (the metric nexus_limiter_errors_total)
    assert third.reason == UNAVAILABLE


def test_a_backend_slot_freed_here_is_taken_over_before_its_release_is_sent(
    redis_url: str,
) -> None:
    # Admission control sends a waiting request the moment the one before it
    # ends: its acquire must not race the release still queued behind it.
    one, other = RedisLimiter(redis_url), RedisLimiter(redis_url)

    async def main():
        first = await one.acquire_backend("gpu", 1)
        one.release_backend("gpu", first)
        # The settle task has not written the release yet; the slot is free.
        taken_over = await one.acquire_backend("gpu", 1)
        await asyncio.sleep(0)
        await one._flush_settles()
        # Still held (by the new request): nobody else gets it...
        refused = await other.acquire_backend("gpu", 1)
        one.release_backend("gpu", taken_over)
        await one._flush_settles()
        # ...until it is released for good.
        return first, taken_over, refused, await other.acquire_backend("gpu", 1)

    first, taken_over, refused, later = run(main, one, other)

    assert first is not None and taken_over == first
    assert refused is None
    assert later is not None


def test_a_slot_this_process_just_released_can_be_taken_at_once(
    redis_url: str,
) -> None:
    # A release is written to Redis by a background batch, a moment later; an
    # acquire meanwhile (a queued request taking the freed slot) must not be
    # refused for the slot this very process gave back.
    limiter = RedisLimiter(redis_url)

    async def main():
        first = await limiter.acquire_backend("gpu-1", 1)
        assert first is not None
        assert await limiter.acquire_backend("gpu-1", 1) is None  # really full
        limiter.release_backend("gpu-1", first)
        return await limiter.acquire_backend("gpu-1", 1)

    assert run(main, limiter) is not None


def test_a_key_limited_to_one_request_at_a_time_serves_back_to_back_requests(
    redis_url: str,
) -> None:
    # A settle is written ahead of the next command, so a client that waits
    # for each answer before sending the next is never refused for the slot
    # its previous request held.
    limiter = RedisLimiter(redis_url)
    policy = KeyPolicy("nx-serial1", max_concurrency=1, tpm=10_000)

    async def main():
        decisions = []
        for _ in range(20):
            decision = await limiter.admit(policy, 10, 0)
            decisions.append(decision)
            if decision.ticket is not None:
                limiter.settle(decision.ticket, 5, 0)
        return decisions

    decisions = run(main, limiter)

    assert [d.reason for d in decisions] == [""] * 20


def test_expired_concurrency_leases_free_their_slots(redis_url: str) -> None:
    # A process that died holding a slot: its lease expires, and the slot is
    # taken again.
    client = redis.Redis.from_url(redis_url)
    client.zadd("nx:{nx-dead1}:concurrency", {"gone:1": 1000})
    client.close()
    limiter = RedisLimiter(redis_url)
    policy = KeyPolicy("nx-dead1", max_concurrency=1)

    async def main():
        return await limiter.admit(policy, 0, 0), await limiter.admit(policy, 0, 0)

    first, second = run(main, limiter)

    assert first.allowed
    assert second.reason == CONCURRENCY


def test_settles_survive_a_redis_that_lost_its_scripts(redis_url: str) -> None:
    # Redis restarted (its script cache empty) between admission and settle:
    # the settle loads its script again and the spend is counted.
    limiter = RedisLimiter(redis_url)
    policy = KeyPolicy("nx-flushed1", budget_period="month", budget_tokens=1000)
    client = redis.Redis.from_url(redis_url)

    async def main():
        decision = await limiter.admit(policy, 100, 0)
        client.script_flush()
        limiter.settle(decision.ticket, 40, 0)
        await limiter._flush_settles()
        return decision

    decision = run(main, limiter)

    stored = client.hgetall(budget_key("nx-flushed1", decision.ticket.period))
    ttl = client.ttl(budget_key("nx-flushed1", decision.ticket.period))
    client.close()
    assert int(stored[b"st"]) == 40
    assert {v for f, v in stored.items() if f[:3] in (b"ht:", b"hn:")} == {b"0"}
    assert ttl > 0  # a month's counter expires after its period


def test_a_freed_backend_slot_is_free_for_the_next_acquire_after_a_script_flush(
    redis_url: str,
) -> None:
    # A Redis that has loaded the acquire script but not the others (new, or
    # restarted, and this the first release since): the release written behind
    # a request's answer must still reach Redis before the acquire of the
    # request admission control sends next, or that one gets 503 backends_busy.
    limiter = RedisLimiter(redis_url)
    client = redis.Redis.from_url(redis_url)
    client.script_flush()

    async def main():
        first = await limiter.acquire_backend("gpu-2", 1)
        limiter.release_backend("gpu-2", first)
        await asyncio.sleep(0)  # the loop's next turn: the release is written
        return first, await limiter.acquire_backend("gpu-2", 1)

    first, second = run(main, limiter)
    client.close()

    assert first is not None
    assert second is not None and second != first


def test_a_key_slot_freed_by_a_settle_is_free_for_the_next_admit_after_a_script_flush(
    redis_url: str,
) -> None:
    # The same for a key's slot: its settle is written ahead of the next
    # admission, and must run ahead of it too.
    limiter = RedisLimiter(redis_url)
    client = redis.Redis.from_url(redis_url)
    client.script_flush()
    policy = KeyPolicy("nx-serial2", max_concurrency=1)

    async def main():
        first = await limiter.admit(policy, 10, 0)
        limiter.settle(first.ticket, 5, 0)
        return first, await limiter.admit(policy, 10, 0)

    first, second = run(main, limiter)
    client.close()

    assert first.allowed
    assert second.reason == ""
