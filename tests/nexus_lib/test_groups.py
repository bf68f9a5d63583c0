"""Group listeners (breaker, configuration, live usage) through a Redis outage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio
from channels_redis.core import RedisChannelLayer
from django.conf import settings

from nexus_lib import groups
from tests.tcp_cut import TcpCut

GROUP = "nexus.test-groups"


async def _until(condition: Callable[[], Awaitable[Any]], what: str) -> Any:
    deadline = time.monotonic() + 20
    while not (value := await condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return value


@pytest.mark.skipif(not settings.REDIS_URL, reason="the Redis channel layer")
async def test_a_listener_leaves_no_member_behind_after_a_redis_outage(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A member left in the group by the outage would stay for a day: every
    # message to the group sent to it too, and buffered in this process.
    url = urlsplit(settings.REDIS_URL)
    cut = TcpCut((url.hostname or "127.0.0.1", url.port or 6379))
    through_cut = url._replace(netloc=f"127.0.0.1:{cut.port}").geturl()
    prefix = f"asgi-groups-{time.monotonic_ns()}"
    layer = RedisChannelLayer(hosts=[through_cut], prefix=prefix)
    sender = RedisChannelLayer(hosts=[settings.REDIS_URL], prefix=prefix)
    direct = redis.asyncio.from_url(settings.REDIS_URL)
    monkeypatch.setattr(groups, "get_channel_layer", lambda: layer)
    received: list[dict[str, Any]] = []
    listener = asyncio.create_task(groups.listen_to_group(GROUP, received.append))

    async def members() -> set[bytes]:
        return set(await direct.zrange(f"{prefix}:group:{GROUP}", 0, -1))

    async def delivered(text: str) -> bool:
        if any(message.get("text") == text for message in received):
            return True
        await sender.group_send(GROUP, {"type": "test", "text": text})
        await asyncio.sleep(0.1)
        return False

    try:
        (first,) = await _until(members, "the listener to join")
        await _until(lambda: delivered("before"), "a message before the outage")
        cut.cut()
        await _until(
            lambda: _lost_twice(caplog), "the listener to try again in the outage"
        )
        cut.restore()
        await _until(lambda: delivered("after"), "a message after the outage")
        now = await _until(
            lambda: _single_new(members, first), "only the new member in the group"
        )
        assert first not in now
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await layer.close_pools()
        cut.close()
        await sender.flush()  # the prefix's keys
        await sender.close_pools()
        await direct.aclose()


async def _lost_twice(caplog: pytest.LogCaptureFixture) -> bool:
    # Twice: the first attempt's clean-up (leaving the group) ran meanwhile.
    return caplog.text.count("Lost the channel layer listening to") >= 2


async def _single_new(
    members: Callable[[], Awaitable[set[bytes]]], first: bytes
) -> set[bytes] | None:
    now = await members()
    return now if len(now) == 1 and first not in now else None


@pytest.mark.skipif(not settings.REDIS_URL, reason="the Redis channel layer")
def test_members_of_dead_processes_expire_but_live_ones_never_do() -> None:
    # Live listeners re-join well within the expiry; a process that died
    # without leaving is dropped within the hour, not after channels_redis's day.
    expiry = settings.CHANNEL_LAYERS["default"]["CONFIG"]["group_expiry"]
    assert 2 * groups.GROUP_REJOIN_SECONDS <= expiry <= 3600


@pytest.mark.skipif(not settings.REDIS_URL, reason="the Redis channel layer")
async def test_a_busy_listener_still_renews_its_membership(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Messages faster than one per 0.1 s never let the receive time out; the
    # membership must be renewed anyway, or it expires while the group is busy.
    monkeypatch.setattr(groups, "GROUP_REJOIN_SECONDS", 0.5)
    prefix = f"asgi-groups-{time.monotonic_ns()}"
    layer = RedisChannelLayer(hosts=[settings.REDIS_URL], prefix=prefix)
    sender = RedisChannelLayer(hosts=[settings.REDIS_URL], prefix=prefix)
    direct = redis.asyncio.from_url(settings.REDIS_URL)
    monkeypatch.setattr(groups, "get_channel_layer", lambda: layer)
    received: list[dict[str, Any]] = []
    listener = asyncio.create_task(groups.listen_to_group(GROUP, received.append))
    key = f"{prefix}:group:{GROUP}"

    async def joined_at() -> float | None:
        members = await direct.zrange(key, 0, -1, withscores=True)
        return members[0][1] if members else None

    async def busy() -> None:
        while True:
            await sender.group_send(GROUP, {"type": "test"})
            await asyncio.sleep(0.01)

    sending = asyncio.create_task(busy())
    try:
        first = await _until(joined_at, "the listener to join")
        await _until(lambda: _received_some(received), "messages to flow")

        async def renewed() -> bool:
            score = await joined_at()
            return score is not None and score > first

        await _until(renewed, "the membership renewed while messages flow")
    finally:
        sending.cancel()
        listener.cancel()
        await asyncio.gather(sending, listener, return_exceptions=True)
        await sender.flush()
        await layer.close_pools()
        await sender.close_pools()
        await direct.aclose()


async def _received_some(received: list[dict[str, Any]]) -> bool:
    return len(received) > 10
