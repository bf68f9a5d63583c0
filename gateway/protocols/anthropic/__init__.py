"""Anthropic Messages <-> canonical (OpenAI chat completions), both directions.

Inbound (an Anthropic client, ``POST /v1/messages``): ``messages_to_canonical``,
``canonical_to_message``, ``MessageStreamWriter`` (a StreamTranslator), and
``estimate_input_tokens`` for ``count_tokens``.

Outbound (a backend of kind ``anthropic``): ``canonical_to_messages``,
``message_to_canonical``, ``MessageStreamReader`` (a ChunkReader).

What maps to what:

- ``system`` (string or text blocks) <-> leading system message(s);
- text blocks <-> text content (parts); images (``base64`` and ``url``
  sources) <-> ``image_url`` parts (data URLs for base64);
- ``tool_use`` blocks <-> assistant ``tool_calls`` (``input`` <-> JSON
  ``arguments``); ``tool_result`` blocks <-> ``tool`` messages (images in a
  tool result go to the user turn after it; ``is_error`` is not carried);
- ``tools`` (client tools) <-> function tools; ``tool_choice`` auto / any /
  none / tool <-> auto / required / none / named function;
  ``disable_parallel_tool_use`` <-> ``parallel_tool_calls: false``;
- ``stop_sequences`` <-> ``stop``; ``max_tokens``, ``temperature``, ``top_p``,
  ``metadata.user_id`` <-> ``user``;
- stop reasons and usage: see ``wire``.

Thinking blocks are dropped. Documents, server tools and other blocks chat
completions cannot carry are refused (code ``unsupported_content``) when the
request has to be translated; an Anthropic backend gets them untouched.
"""

from gateway.protocols.anthropic.inbound import (
    UNSUPPORTED,
    canonical_to_message,
    estimate_input_tokens,
    messages_to_canonical,
)
from gateway.protocols.anthropic.outbound import (
    DEFAULT_MAX_TOKENS,
    canonical_to_messages,
    message_to_canonical,
)
from gateway.protocols.anthropic.streams import MessageStreamReader, MessageStreamWriter
from gateway.protocols.anthropic.wire import (
    ANTHROPIC_VERSION,
    error_body,
    error_type_for,
    sse_event,
    usage_to_canonical,
)

__all__ = [
    "ANTHROPIC_VERSION",
    "DEFAULT_MAX_TOKENS",
    "UNSUPPORTED",
    "MessageStreamReader",
    "MessageStreamWriter",
    "canonical_to_message",
    "canonical_to_messages",
    "error_body",
    "error_type_for",
    "estimate_input_tokens",
    "message_to_canonical",
    "messages_to_canonical",
    "sse_event",
    "usage_to_canonical",
]
