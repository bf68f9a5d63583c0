"""Inbound surfaces: the client protocols the gateway answers in.

A surface is what a client speaks: its paths, where its key is, how a request
becomes canonical (OpenAI chat) and how canonical answers, streams and errors
go back to it. The proxy does the rest the same way for every surface
(routing, admission, retries, breaker, usage, metrics, client disconnects).

Adding an inbound surface (for example OpenAI Responses or Ollama's API):

1. Write its pure translator in ``gateway/protocols/`` (request -> canonical,
   canonical reply -> its reply, a ``StreamTranslator`` from canonical chunks to
   its wire events, its error body).
2. Subclass ``Surface`` here: set ``protocol`` (the name a backend adapter
   that speaks it natively would have, for pass-through; see
   ``gateway/proxy/outbound.py``), ``native_path``, ``stream_content_type``
   and ``accepts_x_api_key``; implement ``to_canonical``, ``reply``,
   ``stream_writer`` and ``error_body``.
   A surface whose requests are not all chat sets ``Inbound.canonical_endpoint``
   (``embeddings``: the canonical body is an OpenAI embeddings request and
   ``reply`` gets the embeddings reply); one whose answer repeats parts of the
   request keeps them in ``Inbound.context``; one that can answer a request
   without a backend (Ollama's "load the model") sets ``Inbound.ready``.
3. Map its paths to ``(endpoint, surface)`` in ``ENDPOINTS`` (the endpoint is
   the label usage and metrics are recorded under; add it to
   ``usage.models.Endpoint`` and ``usage.buffer.Endpoint``, with a migration).
4. If Nexus's ASGI wiring does not send the path to the proxy yet
   (``nexus_site/asgi.py`` sends ``/v1/*``), add it there.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.protocols import anthropic, ollama, responses
from gateway.protocols.anthropic.wire import encode
from gateway.protocols.base import StreamTranslator, TranslationError, dumps
from gateway.protocols.openai import ChatStreamWriter
from gateway.proxy import sse
from gateway.proxy.errors import ProxyError


@dataclass(slots=True)
class Inbound:
    """A client request made canonical, and what its answer needs."""

    canonical: dict[str, Any]
    stream: bool
    # When the request holds content only its own protocol can carry, the error
    # to answer if it has to be translated (a native backend takes it as is).
    untranslatable: TranslationError | None = None
    wants_usage_chunk: bool = False
    # "chat" or "embeddings": the OpenAI endpoint the canonical body is for.
    canonical_endpoint: str = "chat"
    # What the surface's answer repeats from the request (its own business).
    context: dict[str, Any] | None = None
    # The whole answer, when the request needs no backend once routable.
    ready: bytes | None = None


class Surface:
    """A client protocol: override what differs from OpenAI's."""

    protocol = "openai"
    native_path = "/v1/chat/completions"
    stream_content_type = b"text/event-stream; charset=utf-8"
    # Its streams are JSON lines (Ollama's) rather than server-sent events.
    is_ndjson = False
    accepts_x_api_key = False
    key_hint = "'Authorization: Bearer <key>'"

    def to_canonical(self, payload: dict[str, Any]) -> Inbound:
        """Check a parsed body and make it canonical; raise ProxyError if bad."""
        options = payload.get("stream_options")
        return Inbound(
            canonical=payload,
            stream=payload.get("stream") is True,
            wants_usage_chunk=isinstance(options, dict)
            and options.get("include_usage") is True,
        )

    def reply(self, canonical: dict[str, Any], model: str, inbound: Inbound) -> bytes:
        """A canonical ``chat.completion`` (or embeddings list) as this
        protocol's answer."""
        return dumps(canonical)

    def stream_writer(self, inbound: Inbound, model: str) -> StreamTranslator:
        """A writer of canonical chunks as this protocol's stream."""
        return ChatStreamWriter(inbound.wants_usage_chunk)

    def error_body(self, error: ProxyError) -> bytes:
        """The body of an error answer in this protocol's shape."""
        return error.body()

    def text_of_event(self, event: dict[str, Any]) -> int:
        """Characters of generated text in one parsed event of this protocol's
        stream (to meter a passed-through stream against a budget)."""
        return sse.text_of_chunk(event)


class AnthropicSurface(Surface):
    """Anthropic's Messages API (``POST /v1/messages``)."""

    protocol = "anthropic"
    native_path = "/v1/messages"
    accepts_x_api_key = True
    key_hint = "'x-api-key: <key>' or 'Authorization: Bearer <key>'"

    def to_canonical(self, payload: dict[str, Any]) -> Inbound:
        untranslatable = None
        try:
            canonical = anthropic.messages_to_canonical(payload)
        except TranslationError as error:
            if error.code != anthropic.UNSUPPORTED:
                raise translation_error(error) from None
            untranslatable = error
            canonical = anthropic.messages_to_canonical(payload, skip_unsupported=True)
        return Inbound(
            canonical=canonical,
            stream=payload.get("stream") is True,
            untranslatable=untranslatable,
        )

    def reply(self, canonical: dict[str, Any], model: str, inbound: Inbound) -> bytes:
        return encode(anthropic.canonical_to_message(canonical, model))

    def stream_writer(self, inbound: Inbound, model: str) -> StreamTranslator:
        return anthropic.MessageStreamWriter(model)

    def error_body(self, error: ProxyError) -> bytes:
        return anthropic.error_body(error.status, error.message)

    def text_of_event(self, event: dict[str, Any]) -> int:
        delta = (
            event.get("delta") if event.get("type") == "content_block_delta" else None
        )
        text = delta.get("text") if isinstance(delta, dict) else None
        return len(text) if isinstance(text, str) else 0


class ResponsesSurface(Surface):
    """OpenAI's Responses API (``POST /v1/responses``), served statelessly.

    No backend speaks it natively here (``protocol`` is its own): every request
    is translated, so OpenAI-compatible servers without it serve it too.
    """

    protocol = "openai-responses"
    native_path = "/v1/responses"

    def to_canonical(self, payload: dict[str, Any]) -> Inbound:
        try:
            canonical = responses.responses_to_chat(payload)
        except TranslationError as error:
            raise translation_error(error) from None
        context = {
            "request": payload,
            "id": f"resp_{secrets.token_hex(16)}",
            "created_at": int(time.time()),
        }
        return Inbound(
            canonical=canonical,
            stream=canonical.get("stream") is True,
            context=context,
        )

    def reply(self, canonical: dict[str, Any], model: str, inbound: Inbound) -> bytes:
        context = inbound.context or {}
        response = responses.chat_to_response(
            canonical,
            context.get("request", {}),
            response_id=context.get("id", "resp_0"),
            created_at=context.get("created_at", 0),
        )
        return dumps(response)

    def stream_writer(self, inbound: Inbound, model: str) -> StreamTranslator:
        context = inbound.context or {}
        return responses.ResponsesStreamTranslator(
            context.get("request", {}),
            response_id=context.get("id", "resp_0"),
            created_at=context.get("created_at", 0),
        )


class OllamaSurface(Surface):
    """One of Ollama's inference paths (``/api/chat``, ``/api/generate``,
    ``/api/embed``, ``/api/embeddings``), answered in Ollama's shapes.

    Ollama backends get the body as it came (pass-through, ``protocol``
    "ollama"); others get it translated. Fields only Ollama understands
    (``suffix``, ``raw``, ``template``, ``context`` of a generate) are refused
    for those with a 400 naming the field.
    """

    protocol = "ollama"
    stream_content_type = b"application/x-ndjson"
    is_ndjson = True

    def __init__(self, path: str) -> None:
        self.native_path = path
        self._parse = _OLLAMA_PARSERS[path]

    def text_of_event(self, event: dict[str, Any]) -> int:
        message = event.get("message")
        text = message.get("content") if isinstance(message, dict) else None
        if text is None:
            text = event.get("response")  # /api/generate
        return len(text) if isinstance(text, str) else 0

    def to_canonical(self, payload: dict[str, Any]) -> Inbound:
        try:
            request = self._parse(payload)
        except TranslationError as error:
            raise translation_error(error) from None
        untranslatable = None
        if request.native_only:
            field = request.native_only[0]
            untranslatable = TranslationError(
                400,
                f"'{field}' is only understood by Ollama backends, and this model "
                "is served by another kind.",
                param=field,
                code="unsupported_parameter",
            )
        ready = None
        if request.load_only:
            answer = ollama.load_reply(
                self.native_path,
                request.model,
                created_at=ollama.timestamp(time.time()),
            )
            ready = dumps(answer)
        return Inbound(
            canonical=request.canonical,
            stream=request.stream,
            untranslatable=untranslatable,
            canonical_endpoint=request.endpoint,
            context={"model": request.model, "started": time.monotonic_ns()},
            ready=ready,
        )

    def reply(self, canonical: dict[str, Any], model: str, inbound: Inbound) -> bytes:
        context = inbound.context or {}
        requested = context.get("model", model)
        elapsed = time.monotonic_ns() - context.get("started", time.monotonic_ns())
        path = self.native_path
        created_at = ollama.timestamp(time.time())
        if path == "/api/chat":
            answer = ollama.chat_reply(
                canonical, requested, created_at=created_at, total_ns=elapsed
            )
        elif path == "/api/generate":
            answer = ollama.generate_reply(
                canonical, requested, created_at=created_at, total_ns=elapsed
            )
        elif path == "/api/embed":
            answer = ollama.embed_reply(canonical, requested, total_ns=elapsed)
        else:
            answer = ollama.embeddings_reply(canonical)
        return dumps(answer)

    def stream_writer(self, inbound: Inbound, model: str) -> StreamTranslator:
        context = inbound.context or {}
        if self.native_path == "/api/chat":
            return ollama.OllamaStreamTranslator(
                "/api/chat", context.get("model", model)
            )
        return ollama.OllamaStreamTranslator(
            "/api/generate", context.get("model", model)
        )

    def error_body(self, error: ProxyError) -> bytes:
        return ollama.error_body(error.message)


_OLLAMA_PARSERS: dict[str, Callable[[dict[str, Any]], ollama.OllamaRequest]] = {
    "/api/chat": ollama.parse_chat,
    "/api/generate": ollama.parse_generate,
    "/api/embed": ollama.parse_embed,
    "/api/embeddings": ollama.parse_embeddings,
}

OPENAI = Surface()
ANTHROPIC = AnthropicSurface()
RESPONSES = ResponsesSurface()

# Path -> (endpoint label for usage and metrics, surface).
ENDPOINTS: dict[str, tuple[str, Surface]] = {
    "/v1/chat/completions": ("chat", OPENAI),
    "/v1/completions": ("completions", OPENAI),
    "/v1/embeddings": ("embeddings", OPENAI),
    "/v1/messages": ("messages", ANTHROPIC),
    "/v1/responses": ("responses", RESPONSES),
    "/api/chat": ("ollama-chat", OllamaSurface("/api/chat")),
    "/api/generate": ("ollama-generate", OllamaSurface("/api/generate")),
    "/api/embed": ("ollama-embed", OllamaSurface("/api/embed")),
    "/api/embeddings": ("ollama-embed", OllamaSurface("/api/embeddings")),
}
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
# Ollama's endpoints that need no backend, with their methods.
OLLAMA_INFO_PATHS: dict[str, tuple[str, ...]] = {
    "/": ("GET",),
    "/api/version": ("GET",),
    "/api/tags": ("GET",),
    "/api/ps": ("GET",),
    "/api/show": ("POST",),
}
# Ollama's model management, passed to the backend the operator names for keys
# that may (gateway/proxy/model_management.py).
OLLAMA_MANAGEMENT_PATHS = frozenset(
    {"/api/pull", "/api/push", "/api/create", "/api/delete", "/api/copy"}
)
# Ollama's model files (``HEAD``/``POST /api/blobs/<digest>``), uploaded for
# ``/api/create`` under the same rules as model management.
OLLAMA_BLOBS_PREFIX = "/api/blobs/"


def is_ollama_blob(path: str) -> bool:
    """Whether `path` names one of Ollama's model files (a blob)."""
    return path.startswith(OLLAMA_BLOBS_PREFIX) and len(path) > len(OLLAMA_BLOBS_PREFIX)


# The Ollama API version Nexus answers as (what its native surface imitates).
OLLAMA_VERSION = b'{"version":"0.9.0"}'
# Every path of Ollama's API that the gateway answers (the ASGI wiring's list).
OLLAMA_PATHS = frozenset(
    {path for path in ENDPOINTS if path.startswith("/api/")}
    | set(OLLAMA_INFO_PATHS)
    | OLLAMA_MANAGEMENT_PATHS
)


def translation_error(error: TranslationError) -> ProxyError:
    """A translator's refusal as the proxy's error (rendered by the surface)."""
    return ProxyError(error.status, error.message, param=error.param, code=error.code)


def near_miss(path: str) -> str | None:
    """The gateway path `path` was likely meant as, or None.

    A doubled slash or a trailing one (``//v1/chat/completions``,
    ``/api/chat/``), or an SDK whose base URL lacks ``/v1``
    (``/chat/completions``), is not a path of the gateway, but its client
    meant one: it is answered in that path's surface with a 404 that names
    it, rather than by Django's pages.
    """
    canonical = "/" + "/".join(part for part in path.split("/") if part)
    if canonical != path and (
        canonical in OLLAMA_PATHS or canonical == "/v1" or canonical.startswith("/v1/")
    ):
        return canonical
    # An SDK given the server's root as its base URL, not .../v1.
    under_v1 = "/v1" + canonical
    if under_v1 in ENDPOINTS or under_v1 == "/v1/models":
        return under_v1
    return None
