"""Outbound adapters: how the proxy speaks to each kind of backend.

An adapter knows one backend protocol: the headers its key goes in, the path
and body of a canonical chat request, how to read its replies, streams and
errors back as canonical, and where its usage is. The proxy picks one per
target by backend kind (``adapter_for``). When the client's protocol
(``Surface.protocol``) is one of the adapter's ``native_protocols``, the
request is passed through: the
client's body goes upstream (only the model renamed) and the answer comes back
byte for byte, with usage read on the way.

Adding a backend protocol (for example Ollama's native API):

1. Write its pure translator in ``gateway/protocols/`` (canonical request ->
   its request, its reply -> canonical, a ``ChunkReader`` from its stream
   events to canonical chunks).
2. Subclass ``BackendAdapter`` here: ``protocol`` (the one canonical requests
   are written in), ``native_protocols`` (the inbound surfaces' ``protocol``
   values whose bodies it takes as they are: Ollama backends take OpenAI's
   and Ollama's), ``chat_path``, ``embeddings_path`` (None: no embeddings),
   ``headers``, ``request_body``, ``read_reply``, ``chunk_reader``, ``read_error``, and for
   pass-through ``usage_of_reply``, ``usage_of_event`` and ``usage_marker``
   (bytes every usage-carrying native event contains). ``splitter`` cuts a
   stream into events and ``parse_event`` turns one raw event (an SSE event
   with its blank line, or an NDJSON line) into a dict; ``is_stream`` says
   whether a response is a stream. The three take ``native`` (a passed-through
   stream, in the client's protocol, or a translated one).
3. Map the backend kind(s) to it in ``ADAPTERS``.
"""

from __future__ import annotations

from typing import Any

from gateway.protocols import anthropic, ollama
from gateway.protocols.base import ChunkReader, dumps, loads
from gateway.protocols.openai import ChatChunkReader, error_message
from gateway.protocols.prompt_cache import add_breakpoints, usage_with_cache_timings
from gateway.proxy.sse import EventSplitter, LineSplitter
from routing.core import BackendSpec


class MalformedReply(ValueError):
    """A backend's answer is not what its protocol says (the backend's fault)."""


class BackendAdapter:
    """OpenAI-compatible backends (OpenAI, vLLM, llama.cpp, Ollama's /v1)."""

    protocol = "openai"
    # The client protocols whose bodies this backend takes as they are.
    native_protocols: tuple[str, ...] = ("openai",)
    chat_path = "/v1/chat/completions"
    # Where canonical embeddings requests go (None: this protocol has none).
    embeddings_path: str | None = "/v1/embeddings"
    # Bytes that a passed-through stream event carrying usage contains.
    usage_marker = b'"usage"'

    def headers(
        self, backend: BackendSpec, request_id: str, client: dict[str, str]
    ) -> dict[str, str]:
        """Request headers, the backend's key included."""
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            "x-request-id": request_id,
        }
        if backend.api_key:
            headers["authorization"] = f"Bearer {backend.api_key}"
        return headers

    def request_body(
        self, canonical: dict[str, Any], model: str, breakpoints: bool = False
    ) -> bytes:
        """A canonical chat request for this backend, for ``model``.

        ``breakpoints``: add prompt-cache breakpoints where the protocol has
        them (``with_breakpoints``).
        """
        body = {**canonical, "model": model}
        if body.get("stream") is True:
            options = body.get("stream_options")
            options = dict(options) if isinstance(options, dict) else {}
            options["include_usage"] = True
            body["stream_options"] = options
        return dumps(body)

    def request_body_native(self, payload: dict[str, Any], model: str) -> bytes:
        """The client's own body (passed through) for ``model``."""
        body = {**payload, "model": model}
        return dumps(body)

    def with_breakpoints(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """A request body of this protocol with Nexus's prompt-cache
        breakpoints (None: unchanged; this protocol has none)."""
        return None

    def read_reply(self, body: bytes, created: int) -> dict[str, Any]:
        """A whole reply as a canonical ``chat.completion``; ValueError if not one."""
        reply = loads(body)
        if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
            raise MalformedReply("not a chat completion")
        if "timings" in reply or "tokens_cached" in reply:
            reply["usage"] = usage_with_cache_timings(reply)
        return reply

    def chunk_reader(self, created: int) -> ChunkReader:
        """A reader of this backend's stream events into canonical chunks."""
        return ChatChunkReader()

    def read_error(self, body: bytes) -> str | None:
        """The message of an error body in this backend's shape, if it is one."""
        try:
            return error_message(loads(body))
        except ValueError:
            return None

    def is_stream(self, content_type: str, native: bool = False) -> bool:
        return "event-stream" in content_type

    def splitter(self, native: bool = False) -> EventSplitter | LineSplitter:
        """Cuts this backend's stream (``native``: passed through) into events."""
        return EventSplitter()

    def parse_event(self, event: bytes, native: bool = False) -> dict[str, Any] | None:
        """One raw SSE event's JSON data (None for comments, [DONE], no data)."""
        data = _data_of(event)
        if data is None or data == b"[DONE]":
            return None
        value = loads(data)
        if not isinstance(value, dict):
            raise MalformedReply("an event that is not a JSON object")
        return value

    def usage_of_reply(self, body: bytes) -> dict[str, Any] | None:
        """Canonical usage of a native (passed-through) whole reply."""
        try:
            reply = loads(body)
        except ValueError:
            return None
        usage = reply.get("usage") if isinstance(reply, dict) else None
        return usage if isinstance(usage, dict) else None

    def usage_of_event(
        self, event: dict[str, Any], usage: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Update ``usage`` (this protocol's fields) from a passed-through event;
        return the canonical usage known so far (None: none yet)."""
        found = event.get("usage")
        return found if isinstance(found, dict) else None


class AnthropicAdapter(BackendAdapter):
    """Anthropic's Messages API (``POST /v1/messages``)."""

    protocol = "anthropic"
    native_protocols = ("anthropic",)
    chat_path = "/v1/messages"
    embeddings_path = None
    # What an Anthropic client sends that the backend should see when its body
    # is passed through (the version it was written for, beta features).
    forwarded_headers = ("anthropic-version", "anthropic-beta")

    def headers(
        self, backend: BackendSpec, request_id: str, client: dict[str, str]
    ) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            "x-request-id": request_id,
            "anthropic-version": anthropic.ANTHROPIC_VERSION,
        }
        for name in self.forwarded_headers:
            value = client.get(name)
            if value:
                headers[name] = value
        if backend.api_key:
            headers["x-api-key"] = backend.api_key
        return headers

    def request_body(
        self, canonical: dict[str, Any], model: str, breakpoints: bool = False
    ) -> bytes:
        body = anthropic.canonical_to_messages({**canonical, "model": model})
        if breakpoints:
            body = add_breakpoints(body) or body
        return dumps(body)

    def with_breakpoints(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return add_breakpoints(body)

    def read_reply(self, body: bytes, created: int) -> dict[str, Any]:
        message = loads(body)
        if not isinstance(message, dict):
            raise MalformedReply("not an Anthropic Message")
        return anthropic.message_to_canonical(message, created)

    def chunk_reader(self, created: int) -> ChunkReader:
        return anthropic.MessageStreamReader(created)

    def read_error(self, body: bytes) -> str | None:
        try:
            payload = loads(body)
        except ValueError:
            return None
        error = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        return None

    def usage_of_reply(self, body: bytes) -> dict[str, Any] | None:
        try:
            message = loads(body)
        except ValueError:
            return None
        if not isinstance(message, dict):
            return None
        return anthropic.usage_to_canonical(message.get("usage"))

    def usage_of_event(
        self, event: dict[str, Any], usage: dict[str, Any]
    ) -> dict[str, Any] | None:
        # message_start carries the input tokens, message_delta the output ones.
        message = event.get("message")
        found = message.get("usage") if isinstance(message, dict) else None
        if not isinstance(found, dict):
            found = event.get("usage")
        if isinstance(found, dict):
            usage.update({k: v for k, v in found.items() if v is not None})
        return anthropic.usage_to_canonical(usage)


class OllamaAdapter(BackendAdapter):
    """Ollama: OpenAI's API under /v1 for translated requests, and its own
    native API (``/api/chat``, ...) for Ollama clients' bodies, passed through.

    OpenAI clients' requests to it are relayed as for any OpenAI backend (the
    proxy's plain path, no Leg), so the native readers below only ever see
    Ollama's NDJSON and replies.
    """

    native_protocols = ("openai", "ollama")
    usage_marker = b'"eval_count"'

    def is_stream(self, content_type: str, native: bool = False) -> bool:
        if native:
            return "ndjson" in content_type
        return super().is_stream(content_type)

    def splitter(self, native: bool = False) -> EventSplitter | LineSplitter:
        return LineSplitter() if native else EventSplitter()

    def parse_event(self, event: bytes, native: bool = False) -> dict[str, Any] | None:
        if not native:
            return super().parse_event(event)
        if not event.strip():
            return None
        value = loads(event)
        if not isinstance(value, dict):
            raise MalformedReply("a line that is not a JSON object")
        return value

    def usage_of_reply(self, body: bytes) -> dict[str, Any] | None:
        try:
            return ollama.usage_of_native(loads(body))
        except ValueError:
            return None

    def usage_of_event(
        self, event: dict[str, Any], usage: dict[str, Any]
    ) -> dict[str, Any] | None:
        return ollama.usage_of_native(event)


OPENAI_ADAPTER = BackendAdapter()
ANTHROPIC_ADAPTER = AnthropicAdapter()
OLLAMA_ADAPTER = OllamaAdapter()

# Backend kind -> adapter; a kind not listed speaks OpenAI's API.
ADAPTERS: dict[str, BackendAdapter] = {
    "openai": OPENAI_ADAPTER,
    "vllm": OPENAI_ADAPTER,
    "llamacpp": OPENAI_ADAPTER,
    "ollama": OLLAMA_ADAPTER,
    "anthropic": ANTHROPIC_ADAPTER,
}


def adapter_for(kind: str) -> BackendAdapter:
    """The adapter of a backend kind."""
    return ADAPTERS.get(kind, OPENAI_ADAPTER)


def _data_of(event: bytes) -> bytes | None:
    lines = [
        line[5:].lstrip(b" ")
        for line in event.splitlines()
        if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None
