"""A small, strict HTTP/1.1 server protocol on asyncio, built for speed.

It handles what model-server clients send: request line, headers, bodies framed
by Content-Length or chunked transfer encoding, ``Expect: 100-continue``,
keep-alive and pipelining (answers in request order), and ``Connection: close``.
Responses carry a Content-Length, or are streamed with chunked encoding (HTTP/1.0
clients get the stream unframed, ended by closing the connection).

A request is handed to the application's ``handle()``. Quick answers are written
synchronously, with no task per request; an answer that has to wait (latency,
streaming) comes back as a coroutine, and the connection runs it as a task and
holds later pipelined requests until it finishes.

End of input from the client (EOF) is treated as the client going away, as
uvicorn does: a half-closing client cannot wait for a delayed answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from http import HTTPStatus
from typing import Any, Protocol, cast

from nexus_mock.http_parsing import (
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    ProtocolError,
    Request,
    RequestHead,
    decode_chunked,
    parse_head,
)

logger = logging.getLogger(__name__)

# Past this much unprocessed input, stop reading until the handler catches up.
MAX_BUFFERED_BYTES = MAX_HEAD_BYTES + MAX_BODY_BYTES

_REASONS = {status.value: status.phrase for status in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

Header = tuple[str, str]


class HttpApp(Protocol):
    """What a connection needs from the application it serves."""

    def handle(
        self, request: Request, conn: HttpConnection
    ) -> Coroutine[Any, Any, None] | None: ...

    def render_error(self, status: int, message: str) -> tuple[bytes, list[Header]]: ...

    def connection_opened(self, conn: HttpConnection) -> None: ...

    def connection_closed(self, conn: HttpConnection) -> None: ...


class HttpConnection(asyncio.Protocol):
    """One client connection: parse requests in order and write their responses."""

    def __init__(self, app: HttpApp) -> None:
        self._app = app
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._head: RequestHead | None = None
        self._continue_sent = False
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._lost: asyncio.Future[None] = self._loop.create_future()
        self._read_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        # State of the response in progress.
        self._in_response = False
        self._keep_alive = True
        self._http10 = False
        self._chunked = False
        self._streaming = False
        self._pending_head = b""
        # Set by the application to end the connection after this response.
        self.close_after_response = False

    # asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they quack alike.
        self._transport = cast(asyncio.Transport, transport)
        self._app.connection_opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if not self._lost.done():
            self._lost.set_result(None)
        self._wake_drain_waiter()
        self._app.connection_closed(self)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._task is None:
            self._process()
        elif len(self._buffer) > MAX_BUFFERED_BYTES and self._transport:
            self._transport.pause_reading()
            self._read_paused = True

    def eof_received(self) -> bool | None:
        # Returning None closes the transport: see the module docstring.
        return None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain_waiter()

    # For the application

    @property
    def is_open(self) -> bool:
        """True while the client is connected and we have not started closing."""
        return not self._closing

    @property
    def is_idle(self) -> bool:
        """True between requests (nothing being answered, nothing buffered)."""
        return self._task is None and not self._in_response and not self._buffer

    def send(
        self,
        status: int,
        body: bytes,
        headers: Sequence[Header] = (),
        content_type: str = "application/json",
    ) -> None:
        """Write a complete response."""
        if self._closing or self._transport is None:
            return
        framing = f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        self._transport.write(self._render_head(status, headers, framing) + body)
        self._finish_response()

    def start_stream(
        self, status: int, content_type: str, headers: Sequence[Header] = ()
    ) -> None:
        """Begin a streamed response; the head goes out with the first chunk."""
        self._streaming = True
        self._chunked = not self._http10
        if self._http10:
            # HTTP/1.0 has no chunked encoding: the end of the body is the close.
            self._keep_alive = False
        framing = f"Content-Type: {content_type}\r\nCache-Control: no-cache\r\n"
        if self._chunked:
            framing += "Transfer-Encoding: chunked\r\n"
        self._pending_head = self._render_head(status, headers, framing)

    def send_stream(
        self,
        status: int,
        content_type: str,
        headers: Sequence[Header],
        chunks: Sequence[bytes],
    ) -> None:
        """Write a whole streamed response at once (one write, one chunk each)."""
        self.start_stream(status, content_type, headers)
        if self._chunked:
            framed = [
                b"%x\r\n%b\r\n" % (len(chunk), chunk) for chunk in chunks if chunk
            ]
            self._pending_head += b"".join(framed)
        else:
            self._pending_head += b"".join(chunks)
        self.end_stream()

    def send_chunk(self, data: bytes) -> None:
        """Write one piece of a streamed response body."""
        if self._closing or self._transport is None or not data:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        self._transport.write(self._pending_head + data)
        self._pending_head = b""

    def end_stream(self) -> None:
        """Finish a streamed response properly."""
        if self._closing or self._transport is None:
            return
        self._transport.write(
            self._pending_head + (b"0\r\n\r\n" if self._chunked else b"")
        )
        self._pending_head = b""
        self._finish_response()

    def cut(self) -> None:
        """Close the connection in the middle of a streamed response.

        What was written is still delivered, then the connection ends without
        the terminating chunk, as when a backend process dies mid-stream.
        """
        if self._closing or self._transport is None:
            return
        if self._pending_head:
            self._transport.write(self._pending_head)
            self._pending_head = b""
        self._close()

    async def drain(self) -> None:
        """Wait until the client has taken enough of what was written."""
        if self._write_paused and not self._closing:
            self._drain_waiter = self._loop.create_future()
            await self._drain_waiter

    async def sleep(self, seconds: float) -> bool:
        """Sleep, waking early if the client goes away; return True if still open."""
        if seconds > 0 and not self._closing:
            await asyncio.wait((self._lost,), timeout=seconds)
        return not self._closing

    async def wait_for(self, future: asyncio.Future[None]) -> bool:
        """Wait for `future`, waking early if the client goes away; True if done."""
        if not self._closing:
            await asyncio.wait(
                (future, self._lost), return_when=asyncio.FIRST_COMPLETED
            )
        return future.done()

    def close(self) -> None:
        """Close the connection (after writing what is buffered)."""
        self._close()

    def abort(self) -> None:
        """Stop at once: cancel the handler and drop the connection."""
        if self._task is not None:
            self._task.cancel()
        if self._transport is not None:
            self._transport.abort()
        self._closing = True

    # Internals

    def _close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def _wake_drain_waiter(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _render_head(
        self, status: int, headers: Sequence[Header], framing: str
    ) -> bytes:
        reason = _REASONS.get(status, "Unknown")
        lines = [f"HTTP/1.1 {status} {reason}\r\n", framing]
        lines.extend(f"{name}: {value}\r\n" for name, value in headers)
        if not self._keep_alive or self.close_after_response:
            lines.append("Connection: close\r\n")
        elif self._http10:
            lines.append("Connection: keep-alive\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def _finish_response(self) -> None:
        self._in_response = False
        self._streaming = False
        if not self._keep_alive or self.close_after_response:
            self._close()

    def _process(self) -> None:
        """Answer every complete request in the buffer, in order."""
        while self._task is None and not self._closing and self._buffer:
            try:
                request = self._parse_request()
            except ProtocolError as error:
                self._reject(error)
                return
            if request is None:
                return
            self._dispatch(request)
        if self._read_paused and self._transport and not self._closing:
            self._read_paused = False
            self._transport.resume_reading()

    def _dispatch(self, request: Request) -> None:
        self._in_response = True
        self._streaming = False
        self._pending_head = b""
        self._keep_alive = request.keep_alive
        self._http10 = request.version == "HTTP/1.0"
        try:
            pending = self._app.handle(request, self)
        except Exception:
            logger.exception(
                "Mock backend failed on %s %s", request.method, request.path
            )
            self._answer_internal_error()
            return
        if pending is not None:
            self._task = self._loop.create_task(pending)
            self._task.add_done_callback(self._handler_done)
        elif self._in_response:
            logger.error("Handler left %s %s unanswered", request.method, request.path)
            self._answer_internal_error()

    def _handler_done(self, task: asyncio.Task[None]) -> None:
        self._task = None
        if task.cancelled():
            self._close()
            return
        error = task.exception()
        if error is not None:
            logger.error("Mock backend handler failed", exc_info=error)
            self._answer_internal_error()
        elif self._in_response:
            # The handler gave up mid-response (for example, the client left).
            self._close()
        if not self._closing:
            self._process()

    def _answer_internal_error(self) -> None:
        if not self._in_response:
            self._close()
            return
        if self._streaming and not self._pending_head:
            # The status line is out; all we can do is break the stream.
            self.cut()
            return
        self._pending_head = b""
        self._keep_alive = False
        body, headers = self._app.render_error(500, "The mock backend failed.")
        self.send(500, body, headers)

    def _reject(self, error: ProtocolError) -> None:
        self._in_response = True
        self._keep_alive = False
        self._http10 = False
        body, headers = self._app.render_error(error.status, error.message)
        self.send(error.status, body, headers)

    def _parse_request(self) -> Request | None:
        buffer = self._buffer
        head = self._head
        if head is None:
            # RFC 9112 asks servers to ignore empty lines before a request.
            while buffer.startswith(b"\r\n"):
                del buffer[:2]
            head_end = buffer.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
            if head_end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise ProtocolError(431, "The request headers are too large.")
                return None
            head = self._head = parse_head(bytes(buffer[:head_end]))
            del buffer[: head_end + 4]
            self._continue_sent = False
        if head.chunked:
            decoded = decode_chunked(buffer)
            if decoded is None:
                self._send_continue(head)
                return None
            body, end = decoded
        else:
            end = head.content_length
            if len(buffer) < end:
                self._send_continue(head)
                return None
            body = bytes(buffer[:end])
        del buffer[:end]
        self._head = None
        return Request(
            method=head.method,
            target=head.target,
            path=head.path,
            version=head.version,
            headers=head.headers,
            body=body,
            keep_alive=head.keep_alive,
        )

    def _send_continue(self, head: RequestHead) -> None:
        if head.expects_continue and not self._continue_sent and self._transport:
            self._continue_sent = True
            self._transport.write(_CONTINUE)
