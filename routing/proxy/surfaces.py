"""Inbound surfaces: the client protocols the gateway answers in.

A surface is what a client speaks: its paths, where its key is, how a request
becomes canonical (OpenAI chat) and how canonical answers, streams and errors
go back to it. The proxy does the rest the same way for every surface
(routing, admission, retries, breaker, usage, metrics, client disconnects).

Adding an inbound surface (for example OpenAI Responses or Ollama's API):

1. Write its pure translator in ``routing/translate/`` (request -> canonical,
   canonical reply -> its reply, a ``StreamTranslator`` from canonical chunks to
   its wire events, its error body).
2. Subclass ``Surface`` here: set ``protocol`` (the name a backend adapter
   that speaks it natively would have, for pass-through; see
   ``routing/proxy/outbound.py``), ``native_path``, ``stream_content_type``
   and ``accepts_x_api_key``; implement ``to_canonical``, ``reply``,
   ``stream_writer`` and ``error_body``.
3. Map its paths to ``(endpoint, surface)`` in ``ENDPOINTS`` (the endpoint is
   the label usage and metrics are recorded under; add it to
   ``usage.models.Endpoint`` and ``usage.buffer.Endpoint``, with a migration).
4. If Nexus's ASGI wiring does not send the path to the proxy yet
   (``nexus_site/asgi.py`` sends ``/v1/*``), add it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from routing.proxy import sse
from routing.proxy.errors import ProxyError
from routing.translate import anthropic
from routing.translate.anthropic.wire import encode, error_type_for, sse_event
from routing.translate.base import StreamTranslator, TranslationError, dumps
from routing.translate.openai import ChatStreamWriter


@dataclass(slots=True)
class Inbound:
    """A client request made canonical, and what its answer needs."""

    canonical: dict[str, Any]
    stream: bool
    # When the request holds content only its own protocol can carry, the error
    # to answer if it has to be translated (a native backend takes it as is).
    untranslatable: TranslationError | None = None
    wants_usage_chunk: bool = False


class Surface:
    """A client protocol: override what differs from OpenAI's."""

    protocol = "openai"
    native_path = "/v1/chat/completions"
    stream_content_type = b"text/event-stream; charset=utf-8"
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

    def reply(self, canonical: dict[str, Any], model: str) -> bytes:
        """A canonical ``chat.completion`` as this protocol's answer."""
        return dumps(canonical)

    def stream_writer(self, inbound: Inbound, model: str) -> StreamTranslator:
        """A writer of canonical chunks as this protocol's stream."""
        return ChatStreamWriter(inbound.wants_usage_chunk)

    def error_body(self, error: ProxyError) -> bytes:
        """The body of an error answer in this protocol's shape."""
        return error.body()

    def stream_error(self, error: ProxyError) -> bytes:
        """The event that ends a stream with `error` in this protocol."""
        return sse.error_event(error.message, error.code or "", error.error_type)

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

    def reply(self, canonical: dict[str, Any], model: str) -> bytes:
        return encode(anthropic.canonical_to_message(canonical, model))

    def stream_writer(self, inbound: Inbound, model: str) -> StreamTranslator:
        return anthropic.MessageStreamWriter(model)

    def error_body(self, error: ProxyError) -> bytes:
        return anthropic.error_body(error.status, error.message)

    def stream_error(self, error: ProxyError) -> bytes:
        return sse_event(
            {
                "type": "error",
                "error": {
                    "type": error_type_for(error.status),
                    "message": error.message,
                },
            }
        )

    def text_of_event(self, event: dict[str, Any]) -> int:
        delta = (
            event.get("delta") if event.get("type") == "content_block_delta" else None
        )
        text = delta.get("text") if isinstance(delta, dict) else None
        return len(text) if isinstance(text, str) else 0


OPENAI = Surface()
ANTHROPIC = AnthropicSurface()

# Path -> (endpoint label for usage and metrics, surface).
ENDPOINTS: dict[str, tuple[str, Surface]] = {
    "/v1/chat/completions": ("chat", OPENAI),
    "/v1/completions": ("completions", OPENAI),
    "/v1/embeddings": ("embeddings", OPENAI),
    "/v1/messages": ("messages", ANTHROPIC),
}
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


def translation_error(error: TranslationError) -> ProxyError:
    """A translator's refusal as the proxy's error (rendered by the surface)."""
    return ProxyError(error.status, error.message, param=error.param, code=error.code)
