"""Anthropic's Messages API as the mock answers it (``--kind anthropic``).

``POST /v1/messages``: the reply is ``"[<name>/<model>] echo: <last user
text>"`` (text blocks joined by a space; a ``tool_result`` turn echoes ``tool
result: <its text>``), or a ``tool_use`` block by the rule of
``nexus_mock.tools``. Usage: ``input_tokens`` are the words of the
system prompt and every message's text (at least 1), ``output_tokens`` the
words of the reply (or of the tool call's JSON arguments). ``max_tokens``
keeps that many words and stops with ``max_tokens``. Streams are Anthropic's
events: ``message_start``, ``ping``, ``content_block_start``, ``chunks``
deltas (``text_delta`` or ``input_json_delta``), ``content_block_stop``,
``message_delta`` (stop reason, output tokens), ``message_stop``.

``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, counted the same.
Errors are Anthropic's: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from typing import Any

from nexus_mock.ensemble import ensemble_reply
from nexus_mock.jobs import ApiError, parse_json_object
from nexus_mock.replies import encode_json, split_text
from nexus_mock.tools import ToolCall, choose_tool_call

_ids = itertools.count(1)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error(
    status: int, message: str, error_type: str | None = None
) -> ApiError:
    """An ApiError with Anthropic's error body."""
    kind = error_type or _ERROR_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return ApiError(status, message, body=encode_json(body))


def count_tokens(body: bytes, models: Collection[str]) -> bytes:
    """Answer ``/v1/messages/count_tokens``."""
    payload = _parse(body)
    _model(payload, models)
    words, _, _ = _read_turns(payload)
    return encode_json({"input_tokens": words})


def answer_messages(
    body: bytes,
    backend: str,
    models: Collection[str],
    chunks: int,
    scripted: dict[str, Any] | None,
    cache: tuple[int, int] = (0, 0),
) -> bytes | tuple[list[bytes], bytes]:
    """Answer ``/v1/messages``: a Message, or a stream's blocks and its tail.

    ``cache``: the prompt tokens reported as read from and written to the
    prompt cache (beside ``input_tokens``, which excludes them, as Anthropic's).
    """
    payload = _parse(body)
    model = _model(payload, models)
    limit = payload.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise anthropic_error(400, "max_tokens: Field required (a positive integer)")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise anthropic_error(400, "stream: Input should be a valid boolean")
    input_tokens, last_text, user_turn = _read_turns(payload)
    call = None
    if user_turn:
        call = _tool_call(payload, last_text, scripted)
    message_id = f"msg_mock{next(_ids)}"
    if call is not None:
        block: dict[str, Any] = {
            "type": "tool_use",
            "id": f"toolu_mock{message_id[8:]}",
            "name": call.name,
            "input": call.arguments,
        }
        stop, output = "tool_use", call.tokens
    else:
        text = (
            ensemble_reply(backend, model, last_text)
            or f"[{backend}/{model}] echo: {last_text}"
        )
        words = text.split()
        stop = "end_turn"
        if len(words) > limit:
            text, stop = " ".join(words[:limit]), "max_tokens"
        block = {"type": "text", "text": text}
        output = len(text.split())
    usage: dict[str, int] = {"input_tokens": input_tokens, "output_tokens": output}
    if any(cache):
        usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"] = cache
    message = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [block],
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": usage,
    }
    if not stream:
        return encode_json(message)
    return _stream(message, block, call, chunks)


def _stream(
    message: dict[str, Any],
    block: dict[str, Any],
    call: ToolCall | None,
    chunks: int,
) -> tuple[list[bytes], bytes]:
    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "usage": {**usage, "output_tokens": 1},
    }
    if call is not None:
        opened = {**block, "input": {}}
        pieces = split_text(call.arguments_json, chunks)
        deltas = [{"type": "input_json_delta", "partial_json": p} for p in pieces]
    else:
        opened = {"type": "text", "text": ""}
        pieces = split_text(block["text"], chunks)
        deltas = [{"type": "text_delta", "text": p} for p in pieces]
    blocks = [
        _event({"type": "content_block_delta", "index": 0, "delta": delta})
        for delta in deltas
    ]
    blocks[0] = (
        _event({"type": "message_start", "message": start})
        + _event({"type": "ping"})
        + _event({"type": "content_block_start", "index": 0, "content_block": opened})
        + blocks[0]
    )
    tail = (
        _event({"type": "content_block_stop", "index": 0})
        + _event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                # Cumulative, as Anthropic's: the cache counts again with the
                # output tokens.
                "usage": {
                    key: value for key, value in usage.items() if key != "input_tokens"
                },
            }
        )
        + _event({"type": "message_stop"})
    )
    return blocks, tail


def _event(payload: dict[str, Any]) -> bytes:
    return (
        b"event: "
        + payload["type"].encode()
        + b"\ndata: "
        + encode_json(payload)
        + b"\n\n"
    )


def _parse(body: bytes) -> dict[str, Any]:
    try:
        return parse_json_object(body)
    except ApiError as error:
        raise anthropic_error(400, error.message) from None


def _model(payload: dict[str, Any], models: Collection[str]) -> str:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise anthropic_error(400, "model: Field required")
    if model not in models:
        raise anthropic_error(404, f"model: {model}")
    return model


def _read_turns(payload: dict[str, Any]) -> tuple[int, str, bool]:
    """Words of the prompt, the last user turn's text, and whether it is the user's
    own words (not tool results)."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise anthropic_error(400, "messages: Field required (a non-empty array)")
    words = len(_text_of(payload.get("system")).split())
    last_text, user_turn = "", False
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in (
            "user",
            "assistant",
        ):
            raise anthropic_error(
                400, f"messages.{index}: a message needs role user or assistant"
            )
        content = message.get("content")
        text = _text_of(content)
        words += len(text.split())
        if message["role"] == "user":
            results = (
                [
                    _text_of(block.get("content"))
                    for block in content
                    if isinstance(block, dict) and block.get("type") == "tool_result"
                ]
                if isinstance(content, list)
                else []
            )
            if results:
                last_text, user_turn = "tool result: " + " ".join(results), False
            else:
                last_text, user_turn = text, True
    return max(1, words), last_text, user_turn


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = []
    for block in content:
        if isinstance(block, dict):
            if block.get("type") == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif block.get("type") == "tool_result":
                texts.append(_text_of(block.get("content")))
    return " ".join(texts)


def _tool_call(
    payload: dict[str, Any], user_text: str, scripted: dict[str, Any] | None
) -> ToolCall | None:
    tools = payload.get("tools")
    if not isinstance(tools, list):
        return None
    offered = [
        (tool["name"], tool.get("input_schema"))
        for tool in tools
        if isinstance(tool, dict) and isinstance(tool.get("name"), str)
    ]
    choice = payload.get("tool_choice")
    choice = choice if isinstance(choice, dict) else {}
    named = choice.get("name") if choice.get("type") == "tool" else None
    return choose_tool_call(
        offered, named, choice.get("type") == "none", user_text, scripted
    )
