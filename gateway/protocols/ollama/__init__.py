"""Ollama's native API <-> the canonical form (OpenAI chat completions, embeddings).

Requests (``parse_chat``, ``parse_generate``, ``parse_embed``,
``parse_embeddings``) become an ``OllamaRequest``: the canonical body for an
OpenAI-style backend, and what a native backend would honour that the canonical
form cannot carry (``native_only``), so that the surface can pass the body
through to an Ollama backend untouched and refuse those fields clearly anywhere
else.

- ``/api/chat``: ``messages`` (``images`` as base64 become ``image_url`` data
  URLs; assistant ``tool_calls`` with object arguments become JSON-text
  arguments with ids; ``tool`` messages are matched to their call by
  ``tool_call_id``, else ``tool_name``), ``tools``;
- ``/api/generate``: ``system`` and ``prompt`` (+ ``images``) become a chat;
  ``suffix``, ``raw``, ``template`` and ``context`` are native only;
- both: ``stream`` (Ollama's default is true), ``format`` (``"json"`` ->
  ``json_object``, a schema -> ``json_schema``), ``options``: ``temperature``,
  ``top_p``, ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``
  and ``num_predict`` (-> ``max_tokens``; negative means no limit). The other
  options (``num_ctx``, ``top_k``, ``repeat_penalty``, ...), ``keep_alive``
  and ``think`` have no canonical equivalent and are dropped when translating;
- ``/api/embed`` (``input``, ``dimensions``) and the legacy ``/api/embeddings``
  (``prompt``) become an embeddings request.

A chat with no messages, a generate with an empty prompt, and an embed of
nothing are "load the model" requests in Ollama: ``load_only`` is set and
``load_reply`` answers them.

Replies: ``chat_reply``, ``generate_reply``, ``embed_reply``,
``embeddings_reply`` turn canonical replies into Ollama's (``done``,
``done_reason``, ``prompt_eval_count``, ``eval_count``, durations in
nanoseconds); ``OllamaStreamTranslator`` turns canonical chunks into NDJSON lines
as they come (tool calls go out whole, once their arguments are complete,
because Ollama's arguments are an object). Errors are ``{"error": "..."}``
(``error_body``), also as the last line of a stream that broke off.

For pass-through, ``usage_of_native`` reads the usage of a native reply and
``NativeStreamUsage`` of a native NDJSON stream as it is relayed.
"""

from gateway.protocols.ollama.passthrough import NativeStreamUsage, usage_of_native
from gateway.protocols.ollama.replies import (
    chat_reply,
    embed_reply,
    embeddings_reply,
    error_body,
    generate_reply,
    load_reply,
    timestamp,
)
from gateway.protocols.ollama.requests import (
    OllamaRequest,
    parse_chat,
    parse_embed,
    parse_embeddings,
    parse_generate,
)
from gateway.protocols.ollama.streams import OllamaStreamTranslator

__all__ = [
    "NativeStreamUsage",
    "OllamaRequest",
    "OllamaStreamTranslator",
    "chat_reply",
    "embed_reply",
    "embeddings_reply",
    "error_body",
    "generate_reply",
    "load_reply",
    "parse_chat",
    "parse_embed",
    "parse_embeddings",
    "parse_generate",
    "timestamp",
    "usage_of_native",
]
