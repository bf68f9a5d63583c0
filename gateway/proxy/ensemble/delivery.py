"""What the steps of an ensemble send back, caught, and the client's answer.

Every step is an OpenAI chat request that ``forward`` sends like any other;
what it would send a client goes to a sink here instead. ``Collected`` keeps
an intermediate step's whole reply (bounded by the forwarding's reply cap).
``FinalAnswer`` turns the last step's reply (whole or streamed) into the
client's surface as it arrives, named with the model the client asked for;
it can also send a reply the ensemble already holds (``deliver``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.protocols.base import BUDGET, StreamTranslator, loads
from gateway.protocols.openai import error_message
from gateway.proxy import sse
from gateway.proxy.legs import ProxyExchange
from gateway.proxy.relays import Send
from gateway.proxy.surfaces import Inbound, Surface

_JSON = (b"content-type", b"application/json")


def reply_text(reply: dict[str, Any] | None) -> str:
    """The text of a canonical chat.completion's first choice ("" if none)."""
    choices = reply.get("choices") if reply is not None else None
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else ""


class Collected:
    """A step's whole answer as ``forward`` would have sent it (a Send)."""

    __slots__ = ("_parts", "status")

    def __init__(self) -> None:
        self.status = 0
        self._parts: list[bytes] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        else:
            self._parts.append(message.get("body", b""))

    def reply(self) -> dict[str, Any] | None:
        """The canonical reply, if the step answered one (None otherwise)."""
        if not 200 <= self.status < 300:
            return None
        try:
            reply = loads(b"".join(self._parts))
        except ValueError:
            return None
        return reply if isinstance(reply, dict) else None

    def error(self) -> str:
        """What the step answered instead of a reply."""
        return _error_of(self.status, b"".join(self._parts))


class FinalAnswer:
    """The ensemble's answer on its way to the client, in the client's shape.

    Used as the Send of the last step: a failed answer (an error status) is
    kept, not sent, so the ensemble can still answer otherwise
    (``delivered`` stays False). ``on_start`` is called when the step's
    answer begins (its timeout ends there: a stream may take its time).
    """

    def __init__(
        self,
        exchange: ProxyExchange,
        surface: Surface,
        inbound: Inbound,
        send: Send,
    ) -> None:
        self.exchange = exchange
        self.surface = surface
        self.inbound = inbound
        self.send = send
        self.model = exchange.requested_model
        self.on_start: Callable[[], None] | None = None
        self.step: ProxyExchange | None = None  # the step being relayed
        self.failure = ""
        self.delivered = False  # the client has an answer (or its start)
        self._status = 0
        self._streamed = False
        self._parts: list[bytes] = []
        self._splitter = sse.EventSplitter()
        self._writer: StreamTranslator | None = None
        self._backend = ""

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self._start(message)
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self._streamed and self._status < 300:
            await self._relay(body, more)
            return
        self._parts.append(body)
        if more:
            return
        whole = b"".join(self._parts)
        self._parts.clear()
        if self._status >= 300:
            self.failure = _error_of(self._status, whole)
            return
        try:
            reply = loads(whole)
        except ValueError:
            reply = None
        if isinstance(reply, dict) and isinstance(reply.get("choices"), list):
            await self.deliver(reply)
        else:
            self.failure = "the backend's answer was not a chat completion"

    async def deliver(self, reply: dict[str, Any], backend: str = "") -> None:
        """Send a whole canonical reply (as a one-chunk stream if streamed)
        that `backend` gave."""
        self._backend = backend or self._backend
        reply = {**reply, "model": self.model}
        surface, inbound = self.surface, self.inbound
        if not inbound.stream:
            body = surface.reply(reply, self.model, inbound)
            await self._head((_JSON, (b"content-length", str(len(body)).encode())))
            await self.send({"type": "http.response.body", "body": body})
            return
        writer = surface.stream_writer(inbound, self.model)
        out: list[bytes] = []
        for chunk in _chunks_of(reply):
            out += writer.feed(chunk)
        out += writer.finish()
        await self._stream_head()
        await self.send({"type": "http.response.body", "body": b"".join(out)})

    def _start(self, message: dict[str, Any]) -> None:
        self._status = message["status"]
        content_type = b""
        for name, value in message.get("headers", ()):
            if name == b"content-type":
                content_type = value
        self._streamed = content_type.startswith(b"text/event-stream")
        if self.step is not None:
            self._backend = self.step.backend
        if self.on_start is not None:
            self.on_start()

    async def _relay(self, data: bytes, more: bool) -> None:
        """Write the step's stream events for the client as they come."""
        if self._writer is None:
            self._writer = self.surface.stream_writer(self.inbound, self.model)
            await self._stream_head()
        writer = self._writer
        out: list[bytes] = []
        ended = False
        for event in self._splitter.feed(data):
            try:
                chunk = sse.event_payload(event)
            except ValueError:
                chunk = {"error": {"message": "an invalid stream event"}}
            if chunk is None:
                continue
            if "error" in chunk and not chunk.get("choices"):
                if _error_code(chunk) == BUDGET:
                    # Cut by the key's budget meter: the client's own error.
                    out += writer.fail(error_message(chunk) or BUDGET, BUDGET)
                else:
                    reason = error_message(chunk) or "the backend failed"
                    out += writer.fail(f"The refined answer broke off: {reason}")
                ended = True
                break
            chunk["model"] = self.model
            out += writer.feed(chunk)
        if not more and not ended:
            out += writer.finish()
        if ended:
            self._streamed = False  # the rest is not the client's
            self._status = 599
            more = False
        if out or not more:
            await self.send(
                {"type": "http.response.body", "body": b"".join(out), "more_body": more}
            )

    async def _stream_head(self) -> None:
        await self._head(
            (
                (b"content-type", self.surface.stream_content_type),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
            )
        )

    async def _head(self, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        self.delivered = True
        exchange = self.exchange
        exchange.first_byte = time.perf_counter()
        served = (
            ((b"x-nexus-backend", self._backend.encode()),) if self._backend else ()
        )
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*headers, *exchange.response_headers, *served],
            }
        )


def _chunks_of(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat.completion as the chunks of a stream."""
    base = {
        "id": reply.get("id") or "chatcmpl-ensemble",
        "object": "chat.completion.chunk",
        "created": reply.get("created") or int(time.time()),
        "model": reply.get("model", ""),
    }
    finish = "stop"
    choices = reply.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else {}
    if isinstance(first, dict) and isinstance(first.get("finish_reason"), str):
        finish = first["finish_reason"]
    chunks = [
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": reply_text(reply)},
                    "finish_reason": None,
                }
            ],
        },
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
    ]
    usage = reply.get("usage")
    if isinstance(usage, dict):
        chunks.append({**base, "choices": [], "usage": usage})
    return chunks


def _error_code(chunk: dict[str, Any]) -> str:
    error = chunk.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else ""


def _error_of(status: int, body: bytes) -> str:
    try:
        message = error_message(loads(body))
    except ValueError:
        message = None
    return message or f"HTTP {status}"
