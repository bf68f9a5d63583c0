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
from usage.limits.redis_keys import budget_key
from usage.limits.redis_limiter import RedisLimiter
from usage.limits.reserve import RESERVE_SECONDS
from usage.limits.writes import COALESCE_SECONDS

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
        await limiter._writes.flush()
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
        await one._writes.flush()
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
        await two._writes.flush()
        regrown = await one.cover(a.ticket, (700, 0), (800, 0))
        holds += (a.ticket.held_tokens,)
        one.settle(a.ticket, 700, 0)
        await one._writes.flush()
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
        await one._writes.flush()
        # Still held (by the new request): nobody else gets it...
        refused = await other.acquire_backend("gpu", 1)
        one.release_backend("gpu", taken_over)
        await one._writes.flush()
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
        await limiter._writes.flush()
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


# Reserves (usage.limits.reserve.Reserve): a busy key's requests admitted
# here without a round trip, never more than the limits allow gateway-wide.

ROOMY = {
    "rpm": 1_000_000,
    "tpm": 100_000_000,
    "max_concurrency": 10_000,
    "budget_period": "month",
    "budget_tokens": 10**12,
    "budget_nanos": 10**15,
}


def count_round_trips(limiter: RedisLimiter) -> list[int]:
    """Count the limiter's awaited Redis commands (admissions, covers, renews)."""
    calls = [0]
    connection = limiter._redis
    assert connection is not None
    original = connection.run_encoded

    async def counted(*args, **kwargs):
        calls[0] += 1
        return await original(*args, **kwargs)

    connection.run_encoded = counted  # type: ignore[method-assign]
    return calls


def budget_fields(prefix: str, period: str) -> dict[bytes, int]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    stored = client.hgetall(budget_key(prefix, period))
    client.close()
    return {field: int(value) for field, value in stored.items()}


def test_a_busy_keys_requests_are_admitted_without_a_round_trip_each(
    redis_url: str,
) -> None:
    limiter = RedisLimiter(redis_url)
    policy = KeyPolicy("nx-busy1", **{**ROOMY, "rpm": 6000})  # 100 a second

    async def main():
        trips = count_round_trips(limiter)
        decisions = []
        started = time.monotonic()
        for _ in range(200):
            decision = await limiter.admit(policy, 100, 1000)
            decisions.append(decision)
            limiter.settle(decision.ticket, 60, 600)
        elapsed = time.monotonic() - started
        # The settles of a key holding a reserve are summed and written a
        # moment later, all of them.
        await asyncio.sleep(COALESCE_SECONDS + 0.1)
        period = decisions[0].ticket.period
        settled = budget_fields("nx-busy1", period)[b"st"]
        return decisions, trips[0], settled, elapsed

    decisions, trips, settled, elapsed = run(main, limiter)

    assert settled == 200 * 60

    assert all(d.allowed for d in decisions)
    # The first admission takes no reserve (the key was idle), the second and
    # each one after a reserve ran out take 64 more: 200 requests, 5 round
    # trips (and the leases' renewal at start).
    assert trips <= 6, trips
    # Every answer has its rate-limit headers: the bucket as this process sees
    # it, 200 taken and refilled at 100 a second meanwhile.
    remaining = [
        int(dict(d.headers)[b"x-ratelimit-remaining-requests"]) for d in decisions
    ]
    assert remaining[0] == 5999
    assert 5800 <= remaining[-1] <= 5800 + elapsed * 100 + 1, (remaining, elapsed)
    # Spend is settled request by request; the stop gave the reserve back.
    fields = budget_fields("nx-busy1", decisions[0].ticket.period)
    assert fields[b"st"] == 200 * 60 and fields[b"sn"] == 200 * 600
    assert {v for f, v in fields.items() if f[:1] == b"h"} == {0}
    client = redis.Redis.from_url(redis_url)
    assert client.zcard("nx:{nx-busy1}:concurrency") == 0
    client.close()


def test_reserves_never_let_three_processes_past_an_rpm_limit(redis_url: str) -> None:
    # 3 processes admit a busy key's requests as fast as they can: from a full
    # bucket of 3000, 3000 plus 50 a second are admitted, no more, and hardly
    # fewer (near the limit no reserve is granted: each admission is exact).
    limiters = [RedisLimiter(redis_url) for _ in range(3)]
    policy = KeyPolicy("nx-busy2", rpm=3000)

    async def main():
        admitted = 0
        started = time.monotonic()

        async def hammer(limiter: RedisLimiter) -> None:
            nonlocal admitted
            refused_in_a_row = 0
            while refused_in_a_row < 20:
                decision = await limiter.admit(policy, 1, 0)
                if decision.allowed:
                    admitted += 1
                    refused_in_a_row = 0
                else:
                    refused_in_a_row += 1

        await asyncio.gather(*(hammer(limiter) for limiter in limiters))
        return admitted, time.monotonic() - started

    admitted, elapsed = run(main, *limiters)

    ceiling = 3000 + elapsed * 50
    assert ceiling * 0.99 <= admitted <= ceiling + 1, (admitted, elapsed)


def test_reserved_slots_never_exceed_a_keys_concurrency_and_all_come_back(
    redis_url: str,
) -> None:
    one, two = RedisLimiter(redis_url), RedisLimiter(redis_url)
    policy = KeyPolicy("nx-busy3", max_concurrency=1000)

    async def main():
        tickets = []
        refused = {one: False, two: False}
        while not all(refused.values()):
            for limiter in (one, two):
                decision = await limiter.admit(policy, 0, 0)
                if decision.allowed:
                    tickets.append((limiter, decision.ticket))
                else:
                    refused[limiter] = True
        held = len(tickets)
        for limiter, ticket in tickets:
            limiter.settle(ticket, 0, 0)
        return held

    held = run(main, one, two)

    # Exactly the cap: the slots a process holds in reserve are its own to
    # use, and near the cap it holds none idle.
    assert held == 1000
    client = redis.Redis.from_url(redis_url)
    assert client.zcard("nx:{nx-busy3}:concurrency") == 0  # none leaked
    client.close()


def test_reserves_never_overspend_a_budget_across_processes(redis_url: str) -> None:
    one, two = RedisLimiter(redis_url), RedisLimiter(redis_url)
    policy = KeyPolicy("nx-busy4", budget_period="day", budget_tokens=1_000_000)

    async def main():
        spent = 0
        refused = {one: False, two: False}
        while not all(refused.values()):
            for limiter in (one, two):
                decision = await limiter.admit(policy, 1000, 0)
                if decision.allowed:
                    # A stream cut at its hold is billed what it held.
                    held = decision.ticket.held_tokens
                    spent += held
                    limiter.settle(decision.ticket, held, 0)
                else:
                    refused[limiter] = True
                    assert decision.reason == BUDGET
        return spent

    spent = run(main, one, two)

    assert spent == 1_000_000
    fields = budget_fields("nx-busy4", period_id("day", time.time()))
    assert fields[b"st"] == 1_000_000
    assert {v for f, v in fields.items() if f[:1] == b"h"} == {0}


def test_an_unused_reserve_goes_back_after_a_moment(redis_url: str) -> None:
    one, two = RedisLimiter(redis_url), RedisLimiter(redis_url)
    policy = KeyPolicy(
        "nx-busy5", budget_period="month", budget_tokens=100_000, max_concurrency=500
    )

    async def main():
        for _ in range(3):
            decision = await one.admit(policy, 100, 0)
            one.settle(decision.ticket, 100, 0)
        await one._writes.flush()
        # `one` holds a reserve: `two` sees that much less left.
        during = await two.admit(policy, 100_000, 0)
        two.settle(during.ticket, 0, 0)
        await asyncio.sleep(RESERVE_SECONDS + 0.2)
        await one._writes.flush()
        after = await two.admit(policy, 100_000, 0)
        slots = redis.Redis.from_url(redis_url)
        idle = slots.zcard("nx:{nx-busy5}:concurrency")
        slots.close()
        two.settle(after.ticket, 0, 0)
        return during.ticket.held_tokens, after.ticket.held_tokens, idle

    during, after, idle = run(main, one, two)

    assert during < 100_000 - 300
    assert after == 100_000 - 300  # all that is left: the reserve came back
    assert idle == 1  # `two`'s request's slot only: the reserved slots are freed


def test_a_hold_left_by_a_lost_settle_is_corrected_by_the_next_renewal(
    redis_url: str,
) -> None:
    # Settles are written without a reply: one lost with a broken connection
    # would leave its hold, and this process (alive) is not one whose holds
    # the reconciliation drops. Its renewal sets them to what it holds.
    limiter = RedisLimiter(redis_url)
    policy = KeyPolicy("nx-lost1", budget_period="month", budget_tokens=10_000)
    client = redis.Redis.from_url(redis_url)

    async def main():
        decision = await limiter.admit(policy, 100, 0)
        key = budget_key("nx-lost1", decision.ticket.period)
        client.hset(key, f"ht:{limiter.process}", 5000)  # as if a settle was lost
        await limiter.renew()
        while_running = int(client.hget(key, f"ht:{limiter.process}"))
        other = await limiter.admit(policy, 9000, 0)
        limiter.settle(decision.ticket, 100, 0)
        limiter.settle(other.ticket, 0, 0)
        client.hset(key, f"ht:{limiter.process}", 777)
        await limiter.renew()
        return key, while_running, other.ticket.held_tokens

    key, while_running, other_held = run(main, limiter)

    assert while_running == 100
    assert other_held == 9000  # 10,000 - 100 held: the 5000 did not count
    stored = budget_fields("nx-lost1", key.rsplit(":", 1)[1])
    client.close()
    assert stored[f"ht:{limiter.process}".encode()] == 0
    assert stored[b"st"] == 100


def test_near_a_budget_a_settle_is_seen_by_the_other_processes_at_once(
    redis_url: str,
) -> None:
    # No reserve near a limit, and no settle kept back: a client alternating
    # between two processes sees what its previous answer really used.
    one, two = RedisLimiter(redis_url), RedisLimiter(redis_url)
    policy = KeyPolicy("nx-near1", budget_period="day", budget_tokens=10_000)

    async def main():
        held = []
        for index in range(40):
            limiter = (one, two)[index % 2]
            decision = await limiter.admit(policy, 5000, 0)
            held.append(decision.ticket.held_tokens)
            limiter.settle(decision.ticket, 200, 0)
            # The client reads its answer and sends again (over other
            # connections to Redis than the settle's: allow it to arrive).
            await asyncio.sleep(0.003)
        return held

    held = run(main, one, two)

    assert held == [min(5000, 10_000 - 200 * index) for index in range(40)]


def test_a_limiter_that_fails_closed_refuses_at_once_when_redis_goes_down(
    redis_url: str,
) -> None:
    # A busy key holds a reserve; Redis goes away: the reserve is not used
    # once the connection is lost, so a limiter that fails closed answers 503
    # (limits_unavailable) from the first request after, as configured.
    from urllib.parse import urlsplit

    from tests.tcp_cut import TcpCut

    parts = urlsplit(redis_url)
    cut = TcpCut((parts.hostname or "127.0.0.1", parts.port or 6379))
    limiter = RedisLimiter(f"redis://127.0.0.1:{cut.port}{parts.path}", fail_open=False)
    policy = KeyPolicy("nx-closed1", **ROOMY)

    async def main():
        before = [await limiter.admit(policy, 10, 0) for _ in range(3)]
        assert limiter._commands[policy.prefix][1].reserve is not None
        cut.cut()
        await asyncio.sleep(0.05)  # the connection's loss reaches the loop
        return before, await limiter.admit(policy, 10, 0)

    try:
        before, after = run(main, limiter)
    finally:
        cut.close()

    assert all(d.allowed for d in before)
    assert after.reason == UNAVAILABLE


def test_headers_from_a_reserve_show_what_settles_gave_back(redis_url: str) -> None:
    # Each request holds 10 tokens of a 60,000 TPM bucket (refilled at 1 a
    # millisecond) and uses 1: the remaining tokens shown go down by 1 per
    # request, not 10, though most are admitted from a reserve.
    limiter = RedisLimiter(redis_url)
    policy = KeyPolicy("nx-tpmback1", tpm=60_000)

    async def main():
        remaining = []
        for _ in range(30):
            decision = await limiter.admit(policy, 10, 0)
            remaining.append(
                int(dict(decision.headers)[b"x-ratelimit-remaining-tokens"])
            )
            limiter.settle(decision.ticket, 1, 0)
        return remaining, limiter._commands[policy.prefix][1].reserve

    remaining, reserve = run(main, limiter)

    assert reserve is not None  # admitted from a reserve
    assert remaining[-1] >= 60_000 - 10 - 29, remaining  # (300 taken without)


def test_concurrent_requests_of_a_busy_key_lose_no_reserve(redis_url: str) -> None:
    # A process serves 8 of a key's requests at a time (the gateway does):
    # admissions that overlap must not each take a reserve and drop one, or
    # the requests and slots it held are neither used nor given back.
    limiter = RedisLimiter(redis_url)
    policy = KeyPolicy("nx-overlap", **{**ROOMY, "rpm": 6000, "max_concurrency": 2000})
    periods = set()

    async def main():
        admitted = 0

        async def client() -> None:
            nonlocal admitted
            for _ in range(50):
                decision = await limiter.admit(policy, 10, 100)
                assert decision.allowed
                admitted += 1
                periods.add(decision.ticket.period)
                await asyncio.sleep(0.001)  # the request is served
                limiter.settle(decision.ticket, 6, 60)

        round_trips = count_round_trips(limiter)
        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(8)))
        assert round_trips[0] < admitted / 4  # reserves were taken and used
        return admitted, time.monotonic() - started

    admitted, elapsed = run(main, limiter)  # stopping gives the reserve back

    # What a fresh process sees left: all but what was admitted (and refilled).
    fresh = RedisLimiter(redis_url)

    async def look():
        return await fresh.admit(policy, 1, 0)

    # Spend settled exactly, and no hold left behind by a dropped reserve.
    (period,) = periods
    fields = budget_fields("nx-overlap", period)
    assert fields[b"st"] == admitted * 6 and fields[b"sn"] == admitted * 60
    assert {v for f, v in fields.items() if f[:1] == b"h"} == {0}

    after = run(look, fresh)
    remaining = int(dict(after.headers)[b"x-ratelimit-remaining-requests"])
    refilled = (elapsed + 1) * 100  # 6000 a minute, and a second to spare
    assert 6000 - admitted - 1 <= remaining <= 6000 - admitted - 1 + refilled, (
        admitted,
        remaining,
    )
    client = redis.Redis.from_url(redis_url)
    assert client.zcard("nx:{nx-overlap}:concurrency") == 1  # the fresh one's
    client.close()
