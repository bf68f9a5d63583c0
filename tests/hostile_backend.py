"""A hostile model server: one broken behaviour per model name, for the fault tests.

``python -m tests.hostile_backend [--host H] [--port P] [--size N]``
prints ``hostile backend listening on http://HOST:PORT`` once it accepts
connections (what ``spawn_mock_backend(module=...)`` waits for) and serves, on
any POST path, the fault named by the request's ``model`` (``hostile-<mode>``),
plain or streamed as the request's ``"stream"`` asks. ``GET /v1/models`` lists
every mode. Nothing here is a valid server on purpose except ``ok``.

Modes (``--size`` is the number of bytes the big ones send, default 40 MiB):

==================  =============================================================
``ok``              a valid reply (stream or not), for comparison
``non-json-200``    200 ``application/json`` whose body is an HTML page
``html-500``        500 ``text/html`` page holding an internal path and a token
``json-error``      400 in OpenAI's error shape (a real error a client should see)
``huge-body``       200 ``application/json``: a valid reply of ``--size`` bytes,
                    without a ``Content-Length`` (it ends when the connection does)
``endless-event``   a stream whose first event never ends (no blank line), forever
``die-mid-reply``   the head and part of the body, then the connection closes
``hang``            reads the request and never answers
``drip``            a valid reply sent one byte every 200 ms
``wrong-type``      200 ``text/html`` for a stream or a JSON request
``bad-utf8``        invalid UTF-8 inside the JSON (or the first event)
``bad-later``       a stream whose second event is not JSON, then valid events
                    for ever (until the proxy hangs up)
``huge-usage``      a valid reply whose usage says 10**30 prompt and -5
                    completion tokens
``huge-headers``    10 MB of response headers before any body
``lying-length``    ``Content-Length`` of 100000 and 40 bytes, then close
``flood``           a valid stream of 1 kB events that never ends (for a client
                    that stops reading)
==================  =============================================================

Standalone: it imports nothing from Django or the rest of Nexus.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

PAGE = (
    b"<html><head><title>500 Internal Server Error</title></head><body>"
    b"<h1>Internal Server Error</h1><pre>Traceback: /srv/internal/app.py line 42"
    b" SECRET_TOKEN=sk-hostile-secret-123</pre></body></html>"
)
SECRET = "sk-hostile-secret-123"
MODES = (
    "ok",
    "non-json-200",
    "html-500",
    "json-error",
    "huge-body",
    "endless-event",
    "die-mid-reply",
    "hang",
    "drip",
    "wrong-type",
    "bad-utf8",
    "bad-later",
    "huge-usage",
    "huge-headers",
    "lying-length",
    "flood",
)
_CHUNK = 64 * 1024
_MAX_REQUEST = 64 * 1024 * 1024


def _completion(model: str, usage: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-hostile",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello from hostile"},
                "finish_reason": "stop",
            }
        ],
        "usage": usage
        or {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }


def _chunk(model: str, content: str, usage: dict[str, int] | None = None) -> bytes:
    payload: dict[str, Any] = {
        "id": "chatcmpl-hostile",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    if usage is not None:
        payload["choices"] = []
        payload["usage"] = usage
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _head(status: int, content_type: str, length: int | None = None) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 500: "Internal Server Error"}
    lines = [f"HTTP/1.1 {status} {reason.get(status, 'Status')}"]
    lines.append(f"Content-Type: {content_type}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class HostileBackend:
    """Serves each connection's one request with the fault its model names."""

    def __init__(self, size: int) -> None:
        self.size = size

    async def handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            request = await _read_request(reader)
            if request is None:
                return
            method, _path, body = request
            if method == "GET":
                await self._models(writer)
                return
            try:
                payload = json.loads(body)
                model = str(payload.get("model", ""))
                stream = payload.get("stream") is True
            except (ValueError, AttributeError):
                model, stream = "", False
            mode = model.removeprefix("hostile-")
            await self.answer(mode, model, stream, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _models(self, writer: asyncio.StreamWriter) -> None:
        body = json.dumps(
            {
                "object": "list",
                "data": [
                    {"id": f"hostile-{mode}", "object": "model", "owned_by": "hostile"}
                    for mode in MODES
                ],
            }
        ).encode()
        writer.write(_head(200, "application/json", len(body)) + body)
        await writer.drain()

    async def answer(
        self,
        mode: str,
        model: str,
        stream: bool,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        sse = "text/event-stream"
        if mode == "ok":
            if stream:
                writer.write(
                    _head(200, sse) + _chunk(model, "hello") + b"data: [DONE]\n\n"
                )
            else:
                body = json.dumps(_completion(model)).encode()
                writer.write(_head(200, "application/json", len(body)) + body)
        elif mode == "non-json-200":
            writer.write(_head(200, sse if stream else "application/json"))
            writer.write(b"data: <html>not json</html>\n\n" if stream else PAGE)
        elif mode == "html-500":
            writer.write(_head(500, "text/html", len(PAGE)) + PAGE)
        elif mode == "json-error":
            body = json.dumps(
                {
                    "error": {
                        "message": "This model's maximum context length is 8 tokens.",
                        "type": "invalid_request_error",
                        "param": "messages",
                        "code": "context_length_exceeded",
                        "internal_trace": "/srv/internal/app.py",
                    }
                }
            ).encode()
            writer.write(_head(400, "application/json", len(body)) + body)
        elif mode == "huge-body":
            await self._huge_body(model, writer)
        elif mode == "endless-event":
            writer.write(
                _head(200, sse) + b'data: {"choices": [{"delta": {"content": "'
            )
            while True:  # until the proxy hangs up
                writer.write(b"x" * _CHUNK)
                await writer.drain()
        elif mode == "die-mid-reply":
            if stream:
                # Chunked, as real servers stream: the abort is then visibly
                # an incomplete body, not the end of one delimited by close.
                event = _chunk(model, "first ")
                writer.write(
                    _head(200, sse)[:-2]
                    + b"Transfer-Encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n" % (len(event), event)
                )
                await writer.drain()
            else:
                body = json.dumps(_completion(model)).encode()
                writer.write(_head(200, "application/json", len(body)) + body[:20])
                await writer.drain()
            writer.transport.abort()
        elif mode == "hang":
            await reader.read()  # until the proxy gives up and closes
        elif mode == "drip":
            if stream:
                data = _head(200, sse) + _chunk(model, "slow") + b"data: [DONE]\n\n"
            else:
                body = json.dumps(_completion(model)).encode()
                data = _head(200, "application/json", len(body)) + body
            for index in range(len(data)):
                writer.write(data[index : index + 1])
                await writer.drain()
                await asyncio.sleep(0.2)
        elif mode == "wrong-type":
            body = b"<html><body>Welcome to nginx!</body></html>"
            writer.write(_head(200, "text/html", len(body)) + body)
        elif mode == "bad-utf8":
            if stream:
                writer.write(
                    _head(200, sse)
                    + b'data: {"choices": [{"delta": {"content": "\xff\xfe"}}]}\n\n'
                )
            else:
                body = (
                    json.dumps(_completion(model))
                    .encode()
                    .replace(b"hello", b"\xff\xfe")
                )
                writer.write(_head(200, "application/json", len(body)) + body)
        elif mode == "bad-later":
            writer.write(
                _head(200, sse if stream else "application/json")
                + _chunk(model, "fine ")
                + b"data: {broken\n\n"
            )
            # Then valid events for ever: a proxy that went on reading after
            # the broken one would never end the client's stream.
            event = _chunk(model, "more ")
            while stream:
                await writer.drain()
                writer.write(event)
                await asyncio.sleep(0.01)
        elif mode == "huge-usage":
            usage = {
                "prompt_tokens": 10**30,
                "completion_tokens": -5,
                "total_tokens": -1,
            }
            if stream:
                writer.write(
                    _head(200, sse)
                    + _chunk(model, "big")
                    + _chunk(model, "", usage)
                    + b"data: [DONE]\n\n"
                )
            else:
                body = json.dumps(_completion(model, usage)).encode()
                writer.write(_head(200, "application/json", len(body)) + body)
        elif mode == "huge-headers":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
            line = b"X-Filler: " + b"y" * 1000 + b"\r\n"
            for _ in range(10_000):
                writer.write(line)
                await writer.drain()
            writer.write(b"Content-Length: 2\r\n\r\n{}")
        elif mode == "flood":
            writer.write(_head(200, sse))
            event = _chunk(model, "f" * 1000)
            while True:  # until the proxy hangs up
                writer.write(event * 64)
                await writer.drain()
        elif mode == "lying-length":
            body = json.dumps(_completion(model)).encode()[:40]
            writer.write(_head(200, "application/json", 100_000) + body)
            await writer.drain()
        else:
            body = json.dumps(
                {
                    "error": {
                        "message": f"unknown mode {mode!r}",
                        "type": "invalid_request_error",
                    }
                }
            ).encode()
            writer.write(_head(400, "application/json", len(body)) + body)
        await writer.drain()

    async def _huge_body(self, model: str, writer: asyncio.StreamWriter) -> None:
        # A valid JSON object: the completion with a long padding field, written
        # in chunks (with backpressure) so this process never holds it whole.
        start = json.dumps(_completion(model))[:-1].encode() + b', "padding": "'
        end = b'"}'
        padding = max(0, self.size - len(start) - len(end))
        # No Content-Length: the reader must count (the body ends at close).
        writer.write(_head(200, "application/json"))
        writer.write(start)
        block = b"p" * _CHUNK
        while padding > 0:
            piece = block[: min(_CHUNK, padding)]
            writer.write(piece)
            padding -= len(piece)
            await writer.drain()
        writer.write(end)


async def _read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = min(int(value.strip() or 0), _MAX_REQUEST)
    body = await reader.readexactly(length) if length else b""
    return method, path, body


async def _serve(host: str, port: int, size: int) -> None:
    backend = HostileBackend(size)
    server = await asyncio.start_server(backend.handle, host, port, limit=1 << 20)
    address = server.sockets[0].getsockname()
    sys.stdout.write(f"hostile backend listening on http://{address[0]}:{address[1]}\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--size", type=int, default=40 * 1024 * 1024)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.host, args.port, args.size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
