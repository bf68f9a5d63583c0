"""Context enforcement: a chat over the model's ``context_length`` is refused.

With the ``enforce_context`` knob on, a chat request whose prompt counts more
than ``context_length`` tokens (here: whitespace-separated words of its
messages' JSON, plus its tool definitions') is answered with the overflow
error of the kind of server imitated, byte for byte as the real servers
write it (tests/fixtures/context_overflow.json holds the recorded bodies):

- ``llamacpp``: 400, ``exceed_context_size_error`` with ``n_prompt_tokens``
  and ``n_ctx`` (llama.cpp's server since build 6390);
- ``ollama``: 400 ``{"error": "the input length exceeds the context length"}``;
- ``vllm``: 400 ``{"object": "error", "message": "This model's maximum context
  length is ..."}``, the completion's ``max_tokens`` counted;
- ``openai``: 400 with code ``context_length_exceeded``.

Every refusal counts in the stats' ``context_overflows``.
"""

from __future__ import annotations

import json
from typing import Any

from nexus_mock.config import MockConfig
from nexus_mock.jobs import ApiError


def prompt_tokens(payload: dict[str, Any]) -> int:
    """The mock's count of a chat prompt: words of its messages and tools."""
    count = len(json.dumps(payload.get("messages") or []).split())
    if payload.get("tools"):
        count += len(json.dumps(payload["tools"]).split())
    return count


def check_context(config: MockConfig, payload: Any) -> None:
    """Raise the kind's overflow error when the chat does not fit the context."""
    if not config.enforce_context or not isinstance(payload, dict):
        return
    n_ctx = config.context_length
    tokens = prompt_tokens(payload)
    completion = payload.get("max_tokens") or payload.get("max_completion_tokens")
    completion = completion if isinstance(completion, int) else 0
    if config.kind == "vllm":
        if tokens + completion <= n_ctx:
            return
    elif tokens <= n_ctx:
        return
    raise ApiError(
        400,
        "context overflow",
        body=overflow_body(config.kind, tokens, n_ctx, completion),
    )


def overflow_body(kind: str, tokens: int, n_ctx: int, completion: int = 0) -> bytes:
    """The overflow error body of this kind of server."""
    body: dict[str, Any]
    if kind == "llamacpp":
        body = {
            "error": {
                "code": 400,
                "message": f"request ({tokens} tokens) exceeds the available "
                f"context size ({n_ctx} tokens), try increasing it",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": tokens,
                "n_ctx": n_ctx,
            }
        }
    elif kind == "ollama":
        body = {"error": "the input length exceeds the context length"}
    elif kind == "vllm":
        body = {
            "object": "error",
            "message": f"This model's maximum context length is {n_ctx} tokens. "
            f"However, you requested {tokens + completion} tokens ({tokens} in the "
            f"messages, {completion} in the completion). Please reduce the length "
            "of the messages or completion.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    else:
        body = {
            "error": {
                "message": f"This model's maximum context length is {n_ctx} tokens. "
                f"However, your messages resulted in {tokens} tokens. Please reduce "
                "the length of the messages.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
    return json.dumps(body).encode()
