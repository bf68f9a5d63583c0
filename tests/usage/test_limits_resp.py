"""The limiter's own pipelined Redis connection, against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis
from django.conf import settings
from redis.exceptions import ConnectionError, ResponseError

from usage.limits.resp import RespConnection, Script, encode

pytestmark = pytest.mark.skipif(
    not settings.REDIS_URL, reason="the embedded default has no Redis"
)
ECHO = "return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1}"
# The connection's timeout against the real Redis: these tests are about
# replies, not speed; a machine loaded by the rest of the suite once took
# over 5 s to open the connection.
WAIT = 30.0


def test_concurrent_commands_share_one_connection_and_get_their_own_replies() -> None:
    script = Script(ECHO + " -- " + str(id(object())))  # a SHA Redis lacks
    client = redis.Redis.from_url(settings.REDIS_URL)
    assert client.script_exists(script.sha) == [False]

    async def main() -> list:
        connection = RespConnection(settings.REDIS_URL, timeout=WAIT)
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
        connection = RespConnection(settings.REDIS_URL, timeout=WAIT)
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


def test_a_redis_that_stops_answering_fails_the_waiting_commands_then_recovers() -> (
    None
):
    # A server that accepts and reads but never answers: every waiting command
    # fails with a timeout (not a hang), and the next command connects anew.
    async def main() -> None:
        accepted: list[asyncio.StreamWriter] = []

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            accepted.append(writer)
            while await reader.read(1024):
                pass

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        connection = RespConnection(f"redis://127.0.0.1:{port}/0", timeout=0.3)
        try:
            results = await asyncio.gather(
                *(connection.call("PING") for _ in range(3)), return_exceptions=True
            )
            assert all(isinstance(r, TimeoutError) for r in results), results
            assert not connection.is_open
            with pytest.raises(TimeoutError):
                await connection.call("PING")
            assert len(accepted) == 2  # dropped, then opened again
        finally:
            await connection.close()
            server.close()
            for writer in accepted:
                writer.close()

    asyncio.run(main())


def test_a_reply_split_over_many_reads_is_put_together() -> None:
    client = redis.Redis.from_url(settings.REDIS_URL)
    big = b"x" * 300_000
    client.set("nx:resp-big", big)

    async def main() -> list:
        connection = RespConnection(settings.REDIS_URL, timeout=WAIT)
        try:
            return await asyncio.gather(
                connection.call("GET", "nx:resp-big"),
                connection.call("MGET", "nx:resp-big", "nx:resp-missing"),
                connection.call("PING"),
            )
        finally:
            await connection.close()

    try:
        assert asyncio.run(main()) == [big, [big, None], b"PONG"]
    finally:
        client.delete("nx:resp-big")
        client.close()


def test_unanswered_commands_run_in_order_and_keep_the_replies_matched() -> None:
    # The limiter's settles: written after CLIENT REPLY SKIP, alone or ahead
    # of an awaited command; every reply still goes to its own caller.
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete("nx:resp-quiet")
    skip = encode(("CLIENT", "REPLY", "SKIP"))
    incr = skip + encode(("INCR", "nx:resp-quiet"))

    async def main() -> list:
        connection = RespConnection(settings.REDIS_URL, timeout=WAIT)
        try:
            await connection.open()
            assert connection.send_unanswered(incr + incr)
            first = await connection.call("GET", "nx:resp-quiet")
            second = await connection.request(
                encode(("GET", "nx:resp-quiet")), before=incr
            )
            return [first, second, await connection.call("PING")]
        finally:
            await connection.close()

    try:
        assert asyncio.run(main()) == [b"2", b"3", b"PONG"]
    finally:
        client.delete("nx:resp-quiet")
        client.close()
