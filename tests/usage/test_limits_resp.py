"""The limiter's own pipelined Redis connection, against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis
from django.conf import settings
from redis.exceptions import ConnectionError, ResponseError

from usage.limits.resp import RespConnection, Script

pytestmark = pytest.mark.skipif(
    not settings.REDIS_URL, reason="the embedded default has no Redis"
)
ECHO = "return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1}"


def test_concurrent_commands_share_one_connection_and_get_their_own_replies() -> None:
    script = Script(ECHO + " -- " + str(id(object())))  # a SHA Redis lacks
    client = redis.Redis.from_url(settings.REDIS_URL)
    assert client.script_exists(script.sha) == [False]

    async def main() -> list:
        connection = RespConnection(settings.REDIS_URL, timeout=5)
        try:
            replies = await asyncio.gather(
                *(connection.run(script, [f"k{i}"], ["v", i]) for i in range(500))
            )
            clients = await connection.call("CLIENT", "LIST")
            return [replies, clients]
        finally:
            await connection.close()

    replies, _ = asyncio.run(main())
    # Loaded on NOSCRIPT, then every reply went to its own caller, in order.
    assert replies == [[f"k{i}".encode(), b"v", i + 1] for i in range(500)]
    assert client.script_exists(script.sha) == [True]
    client.close()


def test_reply_errors_and_a_lost_connection_raise_redis_errors() -> None:
    async def main() -> None:
        connection = RespConnection(settings.REDIS_URL, timeout=5)
        try:
            with pytest.raises(ResponseError, match="unknown command"):
                await connection.call("NO-SUCH-COMMAND")
            assert await connection.call("PING") == b"PONG"
            # The server drops this connection: waiting commands fail, and the
            # next one opens a new connection.
            own = await connection.call("CLIENT", "ID")
            killer = redis.Redis.from_url(settings.REDIS_URL)
            killer.client_kill_filter(_id=own)
            killer.close()
            with pytest.raises(ConnectionError):
                await connection.call("PING")
            assert await connection.call("PING") == b"PONG"
        finally:
            await connection.close()

    asyncio.run(main())


def test_an_unreachable_redis_is_a_connection_error_within_the_timeout() -> None:
    async def main() -> None:
        connection = RespConnection("redis://127.0.0.1:9/0", timeout=0.5)
        with pytest.raises((ConnectionError, TimeoutError)):
            await connection.call("PING")
        await connection.close()

    asyncio.run(main())
