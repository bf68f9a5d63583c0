"""One pipelined connection to Redis for the limiter: RESP2 written and read here.

redis-py's asyncio client takes a pooled connection, packs, sends, parses and
gives the connection back for every command; on the request path that cost
more than the round trip itself (see docs/benchmarks.md). This
connection writes each command as it is asked for and matches replies to
callers in order, so concurrent requests share one socket and their
round trips overlap (pipelining without batching). It speaks only what the
limiter needs: commands with bulk-string arguments, and RESP2 replies.

It is an ``asyncio.Protocol``: replies are parsed from the received bytes in
the loop's own read callback and handed straight to the waiting callers (no
reader task between them, no await per reply element), and one timer per
connection enforces the timeout instead of one per command. Commands that
Redis is told not to answer (``CLIENT REPLY SKIP`` before each: the limiter's
settles) can be written with no caller waiting (``send_unanswered``), or ahead
of a command that is awaited (``request(data, before=...)``), in the same write.

Errors are redis-py's exception types, so callers handle both alike: a reply
error is ``ResponseError`` (``NoScriptError`` for an unknown script), a lost
or refused connection ``ConnectionError``; Redis not answering within
``timeout`` is ``TimeoutError`` for every command waiting, and closes the
connection (a Redis that stalls that long is treated as down). A broken
connection fails every command waiting on it and is opened again by the next
command.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Iterable
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

from redis.exceptions import ConnectionError, NoScriptError, ResponseError

Reply = bytes | int | list[Any] | None
Arg = str | bytes | int

# A reply larger than this is not one the limiter asks for: the connection is
# dropped rather than buffering without bound.
MAX_BUFFER = 1 << 20


class Script:
    """A Lua script known by its SHA-1, loaded into Redis when Redis lacks it."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


class _Waiter:
    """One command whose reply is awaited."""

    __slots__ = ("deadline", "future")

    def __init__(self, future: asyncio.Future[Reply], deadline: float) -> None:
        self.future = future
        self.deadline = deadline


class _Link(asyncio.Protocol):
    """The protocol of one transport: hands its events to the connection
    while it is the connection's current link (an old one's are ignored)."""

    def __init__(self, owner: RespConnection) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports do not subclass asyncio's: no isinstance.)
        self.transport = cast("asyncio.Transport", transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.owner._link is self:
            self.owner._lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.owner._link is self:
            self.owner._received(data)


class RespConnection:
    """A single Redis connection shared by every caller of one event loop."""

    def __init__(self, url: str, timeout: float, max_reply: int = MAX_BUFFER) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "unix", ""):
            raise ValueError(
                f"only redis:// and unix:// URLs are supported, not {parts.scheme}"
            )
        # unix:///path/to/redis.sock?db=N (the embedded default's private
        # Redis, nexus_site.private_redis), as redis-py reads it.
        self.path = parts.path if parts.scheme == "unix" else None
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        if self.path is not None:
            self.db = int(parse_qs(parts.query).get("db", ["0"])[0])
        else:
            self.db = int(parts.path.strip("/") or 0)
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        self.timeout = timeout
        # A reply (or replies not yet whole) past this drops the connection.
        self.max_reply = max_reply
        self._transport: asyncio.Transport | None = None
        self._link: _Link | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: deque[_Waiter] = deque()
        self._buffer = b""
        self._timer: asyncio.TimerHandle | None = None
        self._connecting: asyncio.Future[None] | None = None

    @property
    def is_open(self) -> bool:
        transport = self._transport
        return transport is not None and not transport.is_closing()

    async def call(self, *args: Arg) -> Reply:
        """Send one command and return its reply."""
        return await self.request(encode(args))

    async def request(self, data: bytes, before: bytes = b"") -> Reply:
        """Send one encoded command (``encode``) and return its reply.

        `before`: encoded commands Redis sends no reply to, written ahead of
        it in the same write.
        """
        if not self.is_open:
            await self._connect()
        return await self._write(before + data if before else data)

    async def run(self, script: Script, keys: list[str], args: list[Any]) -> Reply:
        """EVALSHA the script, loading it first if Redis does not have it."""
        return await self.run_encoded(
            script, encode(("EVALSHA", script.sha, len(keys), *keys, *args))
        )

    async def run_encoded(
        self, script: Script, data: bytes, before: bytes = b""
    ) -> Reply:
        """Send an encoded EVALSHA of `script`; load the script if Redis lacks it.

        `before` as for ``request`` (written once, not again with the retry).
        """
        try:
            return await self.request(data, before)
        except NoScriptError:
            await self.call("SCRIPT", "LOAD", script.source)
            return await self.request(data)

    def send_unanswered(self, data: bytes) -> bool:
        """Write encoded commands that Redis sends no reply to (each one after
        ``CLIENT REPLY SKIP``; anything else would shift every reply after it).

        Nothing reports how they went: a later awaited command's reply means
        that they ran before it. False if the connection is not open.
        """
        transport = self._transport
        if transport is None or transport.is_closing():
            return False
        transport.write(data)
        return True

    async def open(self) -> None:
        """Open the connection if it is not (send_unanswered needs it open)."""
        if not self.is_open:
            await self._connect()

    async def close(self) -> None:
        transport, self._transport, self._link = self._transport, None, None
        if transport is not None:
            transport.close()
        self._fail_waiting(ConnectionError("The limiter's Redis connection closed"))

    # Writing -------------------------------------------------------------------

    def _now(self) -> float:
        return self._loop_or_running().time()

    def _loop_or_running(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _write(self, data: bytes) -> asyncio.Future[Reply]:
        loop = self._loop_or_running()
        future: asyncio.Future[Reply] = loop.create_future()
        self._waiting.append(_Waiter(future, loop.time() + self.timeout))
        self._send(data)
        return future

    def _send(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            # Lost since the caller checked: fail what was just queued.
            self._fail_waiting(ConnectionError("Redis connection lost"))
            return
        transport.write(data)
        if self._timer is None:
            self._arm_timer()

    def _arm_timer(self) -> None:
        if self._waiting:
            loop = self._loop_or_running()
            self._timer = loop.call_at(self._waiting[0].deadline, self._check_timeout)

    def _check_timeout(self) -> None:
        self._timer = None
        if not self._waiting:
            return
        if self._waiting[0].deadline <= self._loop_or_running().time():
            # Redis did not answer in time: treat the connection as broken.
            self._drop(TimeoutError(f"Redis did not answer within {self.timeout} s"))
            return
        self._arm_timer()

    async def _connect(self) -> None:
        # Callers arriving while a connection is being opened wait for it.
        if self._connecting is not None:
            await asyncio.shield(self._connecting)
            if not self.is_open:
                raise ConnectionError("Redis connection lost")
            return
        loop = self._loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            link = _Link(self)
            try:
                async with asyncio.timeout(self.timeout):
                    if self.path is not None:
                        await loop.create_unix_connection(lambda: link, self.path)
                    else:
                        await loop.create_connection(lambda: link, self.host, self.port)
            except OSError as error:
                raise ConnectionError(f"Cannot reach Redis: {error}") from error
            assert link.transport is not None
            # Made current, then the set-up written at once: every command
            # written after it (by any caller) runs after it.
            self._link, self._transport, self._buffer = link, link.transport, b""
            setup: list[tuple[Arg, ...]] = []
            if self.password is not None:
                auth = (self.username, self.password) if self.username else ()
                setup.append(("AUTH", *(auth or (self.password,))))
            if self.db:
                setup.append(("SELECT", self.db))
            futures = [self._write(encode(command)) for command in setup]
            for future in futures:
                await future
            self._connecting.set_result(None)
        except BaseException as error:
            self._connecting.set_exception(error)
            self._connecting.exception()  # retrieved: no "never retrieved" warning
            raise
        finally:
            self._connecting = None

    # Reading -------------------------------------------------------------------

    def _lost(self, exc: Exception | None) -> None:
        self._transport = self._link = None
        self._fail_waiting(ConnectionError(f"Redis connection lost: {exc}"))

    def _received(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        position = 0
        waiting = self._waiting
        try:
            while position < len(buffer):
                parsed = _parse(buffer, position)
                if parsed is None:
                    break
                reply, position = parsed
                self._deliver(waiting.popleft(), reply)  # IndexError: unasked
        except (ValueError, IndexError) as error:
            self._drop(ConnectionError(f"Redis connection broken: {error}"))
            return
        self._buffer = buffer[position:]
        if len(self._buffer) > self.max_reply:
            self._drop(ConnectionError("Redis sent a reply larger than expected"))
        elif not waiting and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _deliver(self, waiter: _Waiter, reply: Reply | ResponseError) -> None:
        future = waiter.future
        if future.done():
            return
        if isinstance(reply, ResponseError):
            future.set_exception(reply)
        else:
            future.set_result(reply)

    def _drop(self, error: Exception) -> None:
        transport, self._transport, self._link = self._transport, None, None
        if transport is not None:
            transport.abort()
        self._fail_waiting(error)

    def _fail_waiting(self, error: Exception) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._buffer = b""
        waiting, self._waiting = self._waiting, deque()
        for waiter in waiting:
            future = waiter.future
            if not future.done():
                future.set_exception(error)
                future.exception()


def encode(args: Iterable[Arg]) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    out = [b""]
    count = 0
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
        count += 1
    out[0] = b"*%d\r\n" % count
    return b"".join(out)


def encode_parts(args: Iterable[Arg]) -> bytes:
    """Arguments in RESP without the array header (to join with others)."""
    out = []
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _parse(buffer: bytes, position: int) -> tuple[Reply | ResponseError, int] | None:
    """Parse one reply at `position`; None when it is not complete yet."""
    end = buffer.find(b"\r\n", position)
    if end < 0:
        return None
    kind = buffer[position]
    if kind == 58:  # ":"
        return int(buffer[position + 1 : end]), end + 2
    if kind == 36:  # "$"
        size = int(buffer[position + 1 : end])
        if size < 0:
            return None, end + 2
        start = end + 2
        if len(buffer) < start + size + 2:
            return None
        return buffer[start : start + size], start + size + 2
    if kind == 42:  # "*"
        count = int(buffer[position + 1 : end])
        position = end + 2
        if count < 0:
            return None, position
        items: list[Any] = []
        failed: ResponseError | None = None
        for _ in range(count):
            parsed = _parse(buffer, position)
            if parsed is None:
                return None
            item, position = parsed
            if isinstance(item, ResponseError):
                failed = failed or item
            items.append(item)
        return (items if failed is None else failed), position
    if kind == 43:  # "+"
        return buffer[position + 1 : end], end + 2
    if kind == 45:  # "-"
        message = buffer[position + 1 : end].decode(errors="replace")
        if message.startswith("NOSCRIPT"):
            return NoScriptError(message), end + 2
        return ResponseError(message), end + 2
    raise ValueError(f"not a RESP reply: {buffer[position : position + 40]!r}")
