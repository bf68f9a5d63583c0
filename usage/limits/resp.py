"""One pipelined connection to Redis for the limiter: RESP2 written and read here.

redis-py's asyncio client takes a pooled connection, packs, sends, parses and
gives the connection back for every command; on the request path that cost
more than the round trip itself (see README, Keys, limits and budgets). This
connection writes each command as it is asked for and matches replies to
callers in order, so concurrent requests share one socket and their
round trips overlap (pipelining without batching). It speaks only what the
limiter needs: commands with bulk-string arguments, and RESP2 replies.

Errors are redis-py's exception types, so callers handle both alike: a reply
error is ``ResponseError`` (``NoScriptError`` for an unknown script), a lost
or refused connection ``ConnectionError``; a reply later than ``timeout`` is
``TimeoutError``. A broken connection fails every command waiting on it and
is opened again by the next command.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import deque
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.exceptions import ConnectionError, NoScriptError, ResponseError

Reply = bytes | int | list[Any] | None


class Script:
    """A Lua script known by its SHA-1, loaded into Redis when Redis lacks it."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


class RespConnection:
    """A single Redis connection shared by every caller of one event loop."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", ""):
            raise ValueError(f"only redis:// URLs are supported, not {parts.scheme}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        self.db = int(parts.path.strip("/") or 0)
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        self.timeout = timeout
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: deque[asyncio.Future[Reply]] = deque()
        self._reader_task: asyncio.Task[None] | None = None
        self._connecting: asyncio.Future[None] | None = None

    async def call(self, *args: str | bytes | int) -> Reply:
        """Send one command and return its reply."""
        async with asyncio.timeout(self.timeout):
            writer = self._writer
            if writer is None or writer.is_closing():
                writer = await self._connect()
            future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
            self._waiting.append(future)
            writer.write(_encode(args))
            return await future

    async def run(self, script: Script, keys: list[str], args: list[Any]) -> Reply:
        """EVALSHA the script, loading it first if Redis does not have it."""
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            return await self.call(*command)
        except NoScriptError:
            await self.call("SCRIPT", "LOAD", script.source)
            return await self.call(*command)

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        task, self._reader_task = self._reader_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        self._fail_waiting(ConnectionError("The limiter's Redis connection closed"))

    async def _connect(self) -> asyncio.StreamWriter:
        # Callers arriving while a connection is being opened wait for it.
        if self._connecting is not None:
            await asyncio.shield(self._connecting)
            assert self._writer is not None
            return self._writer
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError as error:
                raise ConnectionError(f"Cannot reach Redis: {error}") from error
            self._writer = writer
            self._reader_task = loop.create_task(
                self._read_replies(reader), name="limiter-redis-replies"
            )
            setup: list[tuple[str | bytes | int, ...]] = []
            if self.password is not None:
                auth = (self.username, self.password) if self.username else ()
                setup.append(("AUTH", *(auth or (self.password,))))
            if self.db:
                setup.append(("SELECT", self.db))
            futures = []
            for command in setup:
                future: asyncio.Future[Reply] = loop.create_future()
                self._waiting.append(future)
                writer.write(_encode(command))
                futures.append(future)
            for future in futures:
                await future
            self._connecting.set_result(None)
        except BaseException as error:
            self._connecting.set_exception(error)
            self._connecting.exception()  # retrieved: no "never retrieved" warning
            raise
        finally:
            self._connecting = None
        return writer

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                reply = await _read_reply(reader)
                future = self._waiting.popleft()
                if future.done():
                    continue  # its caller timed out or left
                if isinstance(reply, ResponseError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as error:
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()
            self._fail_waiting(ConnectionError(f"Redis connection lost: {error}"))

    def _fail_waiting(self, error: Exception) -> None:
        waiting, self._waiting = self._waiting, deque()
        for future in waiting:
            if not future.done():
                future.set_exception(error)
                future.exception()


def _encode(args: tuple[str | bytes | int, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


async def _read_reply(reader: asyncio.StreamReader) -> Reply | ResponseError:
    line = await reader.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return None
        return (await reader.readexactly(size + 2))[:-2]
    if kind == b"+":
        return rest
    if kind == b"*":
        count = int(rest)
        if count < 0:
            return None
        items: list[Any] = []
        failed: ResponseError | None = None
        for _ in range(count):
            item = await _read_reply(reader)
            if isinstance(item, ResponseError):
                failed = failed or item  # the rest is still read: replies stay aligned
            items.append(item)
        return items if failed is None else failed
    if kind == b"-":
        message = rest.decode(errors="replace")
        if message.startswith("NOSCRIPT"):
            return NoScriptError(message)
        return ResponseError(message)
    raise ValueError(f"not a RESP reply: {line[:40]!r}")
