"""One attempt at one backend when the request is not plain OpenAI to OpenAI.

``forward`` (gateway/proxy/forward.py) relays an OpenAI client's request to an
OpenAI-speaking backend byte for byte, as before. Every other pairing of an
inbound surface and a backend adapter gets a ``Leg``: the request to send
(the client's body passed through when the backend speaks the client's
protocol, else the canonical request written in the backend's), and how the
answer goes back (relayed with its usage read on the way, or read into
canonical form and written in the client's protocol). Retries, the breaker,
live stats, usage and metrics stay in ``forward`` and so are the same for
every surface.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.cache.entries import Pending, ReplyCollector
from gateway.exchange import Exchange
from gateway.protocols.base import (
    BROKEN,
    StreamFailed,
    TranslationError,
    dumps,
    loads,
)
from gateway.proxy.errors import ProxyError
from gateway.proxy.limits import BudgetMeter
from gateway.proxy.outbound import BackendAdapter, MalformedReply
from gateway.proxy.sse import text_of_chunk
from gateway.proxy.surfaces import OPENAI, Inbound, Surface, translation_error
from routing.core import Target

# Past this many bytes in one event (a hostile or broken backend), the stream
# is ended with an error rather than buffered further (the gateway passes
# NEXUS_UPSTREAM_MAX_EVENT_BYTES).
MAX_EVENT_BYTES = 1024 * 1024


class Unservable(Exception):
    """This backend cannot serve this kind of request at all (try the next)."""


@dataclass(slots=True)
class Call:
    """A client request as every leg of it needs it."""

    surface: Surface
    inbound: Inbound
    payload: dict[str, Any]
    raw: bytes
    # Headers of the client's that a native backend may need (lower-case names).
    client_headers: dict[str, str] = field(default_factory=dict)


# One request's exchange as the proxy fills it (gateway/exchange.py sits below
# the proxy and names neither class).
ProxyExchange = Exchange[Call, BudgetMeter]


def openai_call(endpoint: str, payload: dict[str, Any], raw: bytes) -> Call:
    """The Call of an OpenAI client's request (for a backend of another kind)."""
    if endpoint != "chat":
        raise Unservable(f"serves chat completions only, not /v1/{endpoint}")
    return Call(OPENAI, OPENAI.to_canonical(payload), payload, raw)


class Leg:
    """The request for one backend and how its answer goes back to the client."""

    __slots__ = ("adapter", "body", "call", "headers", "native", "path", "target")

    def __init__(
        self,
        call: Call,
        adapter: BackendAdapter,
        target: Target,
        request_id: str,
        breakpoints: bool = False,
    ) -> None:
        """``breakpoints``: add Nexus's prompt-cache breakpoints to a request
        that has none (Anthropic backends; ``[cache]
        anthropic_auto_breakpoints``)."""
        self.call = call
        self.adapter = adapter
        self.target = target
        self.native = call.surface.protocol in adapter.native_protocols
        model = target.model.name
        backend = target.backend
        self.headers = adapter.headers(backend, request_id, call.client_headers)
        self.path = adapter.chat_path
        if self.native:
            self.path = call.surface.native_path
            self.body = call.raw
            payload = call.payload
            marked = adapter.with_breakpoints(payload) if breakpoints else None
            if marked is not None:
                payload = marked
            if marked is not None or payload.get("model") != model:
                self.body = adapter.request_body_native(payload, model)
            return
        inbound = call.inbound
        if inbound.untranslatable is not None:
            raise translation_error(inbound.untranslatable)
        if inbound.canonical_endpoint == "embeddings":
            if adapter.embeddings_path is None:
                raise Unservable("serves chat only, not embeddings")
            self.path = adapter.embeddings_path
            self.body = dumps({**inbound.canonical, "model": model})
            return
        try:
            self.body = adapter.request_body(inbound.canonical, model, breakpoints)
        except TranslationError as error:
            raise translation_error(error) from None

    @property
    def url(self) -> str:
        return self.target.backend.base_url.removesuffix("/v1") + self.path

    def answer(self, exchange: ProxyExchange, status: int, body: bytes) -> bytes:
        """The client's body for a whole answer; note usage on the exchange.

        Raises ValueError when a successful answer is not what the backend's
        protocol says it is (a backend fault, worth another backend).
        """
        adapter, surface = self.adapter, self.call.surface
        if self.native:
            if status < 300:
                exchange.usage = adapter.usage_of_reply(body)
                if exchange.cache is not None:
                    self._keep_native(exchange.cache, body)
            return body
        if status >= 300:
            message = adapter.read_error(body) or (
                f"Backend '{self.target.backend.name}' answered HTTP {status}."
            )
            return surface.error_body(ProxyError(status, message))
        inbound = self.call.inbound
        if inbound.canonical_endpoint == "embeddings":
            canonical = loads(body)
            if not isinstance(canonical, dict) or not isinstance(
                canonical.get("data"), list
            ):
                raise MalformedReply("not an embeddings list")
        else:
            canonical = adapter.read_reply(body, int(time.time()))
        usage = canonical.get("usage")
        exchange.usage = usage if isinstance(usage, dict) else None
        if exchange.usage is None:
            exchange.completion_chars = _reply_chars(canonical)
        if exchange.cache is not None:
            exchange.cache.reply = canonical
        return surface.reply(canonical, self.target.model.name, inbound)

    @property
    def is_native_chat(self) -> bool:
        """A native chat the adapter can read back (its own chat path)."""
        return self.native and self.path == self.adapter.chat_path

    def _keep_native(self, pending: Pending, body: bytes) -> None:
        """A native answer, made canonical for the cache (if it can be)."""
        if not self.is_native_chat:
            pending.unreadable = True
            return
        try:
            pending.reply = self.adapter.read_reply(body, int(time.time()))
        except (ValueError, KeyError, TypeError, TranslationError):
            pending.unreadable = True

    def stream(
        self, max_event: int = MAX_EVENT_BYTES, pending: Pending | None = None
    ) -> LegStream:
        stream = LegStream(self, max_event)
        if pending is not None:
            if self.native and not self.is_native_chat:
                pending.unreadable = True
            else:
                stream.collect(pending)
        return stream


class LegStream:
    """A backend's stream on its way to the client: relayed or translated.

    ``feed`` takes bytes as they arrive and returns the bytes to send (whole
    events only); ``finish`` the closing bytes when the backend's stream ended;
    ``fail`` the client protocol's error event. ``feed`` and ``finish`` raise
    StreamFailed when the backend reported an error or broke its protocol.

    ``feed_counted`` and ``finish_counted`` return the same bytes cut per
    source event, each with the characters of generated text it carries (a
    budgeted stream is metered, and may be cut, event by event).
    """

    __slots__ = (
        "_adapter",
        "_marker",
        "_max_event",
        "_native",
        "_pending",
        "_reader",
        "_seen",
        "_split",
        "_surface",
        "_writer",
        "chars",
        "collector",
        "usage",
    )

    def __init__(self, leg: Leg, max_event: int = MAX_EVENT_BYTES) -> None:
        call = leg.call
        self._max_event = max_event
        self._adapter = leg.adapter
        self._native = leg.native
        self._surface = call.surface
        self._marker = leg.adapter.usage_marker
        self._split = leg.adapter.splitter(leg.native)
        self._reader = (
            None if leg.native else leg.adapter.chunk_reader(int(time.time()))
        )
        self._writer = call.surface.stream_writer(call.inbound, leg.target.model.name)
        self._seen: dict[str, Any] = {}  # a native stream's usage fields so far
        self.usage: dict[str, Any] | None = None
        self.chars = 0  # text written, while no usage is known
        # The response cache's: gets the canonical chunks (None: not cached).
        self.collector: ReplyCollector | None = None
        self._pending: Pending | None = None

    def collect(self, pending: Pending) -> None:
        """Hand the stream's canonical chunks to the cache's collector; a
        native stream is read into canonical chunks for it too."""
        self.collector = pending.collect()
        self._pending = pending
        if self._native:
            self._reader = self._adapter.chunk_reader(int(time.time()))

    def feed(self, data: bytes) -> bytes:
        events = self._split.feed(data)
        # Checked on every feed: complete events may come with a growing one.
        self._check_pending()
        if not events:
            return b""
        if self._native:
            collecting = self.collector is not None
            for event in events:
                if collecting or self._marker in event:
                    parsed = self._parse(event)
                    if parsed is not None and self._marker in event:
                        found = self._adapter.usage_of_event(parsed, self._seen)
                        self.usage = found or self.usage
                    if parsed is not None and collecting:
                        self._collect_native(parsed)
            return b"".join(events)
        out: list[bytes] = []
        for event in events:
            parsed = self._parse(event)
            if parsed is not None:
                out += self._write(parsed)
        return b"".join(out)

    def finish(self) -> bytes:
        if self._native:
            self._finish_native()
            return self._split.rest()
        assert self._reader is not None
        out: list[bytes] = []
        for chunk in self._reader.finish():
            out += self._write_chunk(chunk)
        out += self._writer.finish()
        return b"".join(out)

    def fail(self, message: str, code: str = BROKEN) -> bytes:
        return b"".join(self._writer.fail(message, code))

    def feed_counted(self, data: bytes) -> list[tuple[bytes, int]]:
        events = self._split.feed(data)
        self._check_pending()
        if not events:
            return []
        pieces: list[tuple[bytes, int]] = []
        if self._native:
            text_of_event = self._surface.text_of_event
            for event in events:
                parsed = self._parse(event)
                chars = 0
                if parsed is not None:
                    if self._marker in event:
                        found = self._adapter.usage_of_event(parsed, self._seen)
                        self.usage = found or self.usage
                    chars = text_of_event(parsed)
                    if self.collector is not None:
                        self._collect_native(parsed)
                pieces.append((event, chars))
            return pieces
        assert self._reader is not None
        for event in events:
            parsed = self._parse(event)
            if parsed is not None:
                pieces.append(self._write_counted(self._reader.feed(parsed)))
        return pieces

    def finish_counted(self) -> list[tuple[bytes, int]]:
        if self._native:
            self._finish_native()
            return [(self._split.rest(), 0)]
        assert self._reader is not None
        piece = self._write_counted(self._reader.finish())
        return [piece, (b"".join(self._writer.finish()), 0)]

    def _write_counted(self, chunks: list[dict[str, Any]]) -> tuple[bytes, int]:
        out: list[bytes] = []
        chars = 0
        for chunk in chunks:
            chars += text_of_chunk(chunk)
            out += self._write_chunk(chunk)
        return b"".join(out), chars

    def _write(self, event: dict[str, Any]) -> list[bytes]:
        assert self._reader is not None
        out: list[bytes] = []
        for chunk in self._reader.feed(event):
            out += self._write_chunk(chunk)
        return out

    def _collect_native(self, event: dict[str, Any]) -> None:
        """Read a native event into canonical chunks for the cache's collector."""
        collector, reader = self.collector, self._reader
        if collector is None or reader is None:
            return
        try:
            for chunk in reader.feed(event):
                collector.add(chunk)
        except (StreamFailed, ValueError, KeyError, TypeError):
            self._give_up_collecting()

    def _finish_native(self) -> None:
        collector, reader = self.collector, self._reader
        if collector is None or reader is None:
            return
        try:
            for chunk in reader.finish():
                collector.add(chunk)
        except (StreamFailed, ValueError, KeyError, TypeError):
            self._give_up_collecting()

    def _give_up_collecting(self) -> None:
        if self._pending is not None:
            self._pending.unreadable = True
        self.collector = None

    def _write_chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        if self.collector is not None:
            self.collector.add(chunk)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        elif self.usage is None:
            # Kept for an estimate, in case the backend never reports usage.
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") if isinstance(choice, dict) else None
                text = delta.get("content") if isinstance(delta, dict) else None
                if isinstance(text, str):
                    self.chars += len(text)
        return self._writer.feed(chunk)

    def _parse(self, event: bytes) -> dict[str, Any] | None:
        try:
            return self._adapter.parse_event(event, self._native)
        except (ValueError, UnicodeDecodeError):
            raise StreamFailed("the backend sent a malformed stream event") from None

    def _check_pending(self) -> None:
        if self._split.pending_size > self._max_event:
            raise StreamFailed(
                f"the backend sent a stream event over {self._max_event} bytes"
            )


def _reply_chars(canonical: dict[str, Any]) -> int:
    total = 0
    for choice in canonical.get("choices") or ():
        message = choice.get("message") if isinstance(choice, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
    return total
