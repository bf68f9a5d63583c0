"""Canonical replies -> Ollama's replies, whole.

``chat_reply``, ``generate_reply``, ``embed_reply`` and ``embeddings_reply``
write canonical chat and embeddings replies in Ollama's shape (``done``,
``done_reason``, token counts, durations in nanoseconds, tool call arguments
as objects); ``load_reply`` answers a request that only loads the model,
``error_body`` is Ollama's error and ``timestamp`` its ``created_at``. The
final fields and the tool calls are shared with the stream translator.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from gateway.protocols.base import dumps

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


def chat_reply(
    reply: Mapping[str, Any], model: str, *, created_at: str, total_ns: int
) -> dict[str, Any]:
    """Translate a canonical ``chat.completion`` into an ``/api/chat`` reply."""
    message, finish = _first_choice(reply)
    out_message: dict[str, Any] = {
        "role": "assistant",
        "content": _text_of(message.get("content")),
    }
    thinking = message.get("reasoning_content")
    if isinstance(thinking, str) and thinking:
        out_message["thinking"] = thinking
    calls = _native_tool_calls(message.get("tool_calls"))
    if calls:
        out_message["tool_calls"] = calls
    return {
        "model": model,
        "created_at": created_at,
        "message": out_message,
        **done_fields(finish, reply.get("usage"), total_ns),
    }


def generate_reply(
    reply: Mapping[str, Any], model: str, *, created_at: str, total_ns: int
) -> dict[str, Any]:
    """Translate a canonical ``chat.completion`` into an ``/api/generate`` reply."""
    message, finish = _first_choice(reply)
    out: dict[str, Any] = {
        "model": model,
        "created_at": created_at,
        "response": _text_of(message.get("content")),
    }
    thinking = message.get("reasoning_content")
    if isinstance(thinking, str) and thinking:
        out["thinking"] = thinking
    out.update(done_fields(finish, reply.get("usage"), total_ns))
    return out


def embed_reply(
    reply: Mapping[str, Any], model: str, *, total_ns: int
) -> dict[str, Any]:
    """Translate a canonical embeddings reply into an ``/api/embed`` reply."""
    out: dict[str, Any] = {
        "model": model,
        "embeddings": _vectors(reply),
        "total_duration": total_ns,
        "load_duration": 0,
    }
    usage = reply.get("usage")
    if isinstance(usage, Mapping) and isinstance(usage.get("prompt_tokens"), int):
        out["prompt_eval_count"] = usage["prompt_tokens"]
    return out


def embeddings_reply(reply: Mapping[str, Any]) -> dict[str, Any]:
    """Translate a canonical embeddings reply into a legacy ``/api/embeddings`` one."""
    vectors = _vectors(reply)
    return {"embedding": vectors[0] if vectors else []}


def load_reply(path: str, model: str, *, created_at: str) -> dict[str, Any]:
    """Ollama's answer to a request that only loads the model (nothing to do)."""
    if path == "/api/chat":
        return {
            "model": model,
            "created_at": created_at,
            "message": {"role": "assistant", "content": ""},
            "done_reason": "load",
            "done": True,
        }
    if path == "/api/generate":
        return {
            "model": model,
            "created_at": created_at,
            "response": "",
            "done": True,
            "done_reason": "load",
        }
    if path == "/api/embeddings":
        return {"embedding": []}
    return {"model": model, "embeddings": []}


def error_body(message: str) -> bytes:
    """Ollama's error shape, ``{"error": "..."}``."""
    return dumps({"error": message})


def timestamp(epoch: float) -> str:
    """Format a time as Ollama's ``created_at`` (RFC 3339, UTC)."""
    whole = int(epoch)
    micros = int((epoch - whole) * 1_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{micros:06d}Z"


def _first_choice(reply: Mapping[str, Any]) -> tuple[Mapping[str, Any], Any]:
    choices = reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    if not isinstance(choice, Mapping):
        choice = {}
    message = choice.get("message")
    return (message if isinstance(message, Mapping) else {}), choice.get(
        "finish_reason"
    )


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return ""


def done_fields(finish: Any, usage: Any, total_ns: int) -> dict[str, Any]:
    """The fields of a finished reply or last line: reason, counts, durations."""
    out: dict[str, Any] = {
        "done": True,
        "done_reason": _DONE_REASONS.get(finish, "stop")
        if isinstance(finish, str)
        else "stop",
        "total_duration": total_ns,
        "load_duration": 0,
    }
    if isinstance(usage, Mapping):
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            out["prompt_eval_count"] = prompt
        out["prompt_eval_duration"] = 0
        if isinstance(completion, int):
            out["eval_count"] = completion
        out["eval_duration"] = total_ns
    return out


def _native_tool_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        return []
    out = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            continue
        arguments = function.get("arguments")
        text = (
            _ENCODER.encode(arguments)
            if isinstance(arguments, Mapping)
            else arguments
            if isinstance(arguments, str)
            else ""
        )
        out.append(native_call(index, str(function.get("name") or ""), text))
    return out


def native_call(index: int, name: str, arguments: str) -> dict[str, Any]:
    """An Ollama tool call: the arguments as an object, not JSON text."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        # Ollama's arguments are an object; keep text a model got wrong visible.
        parsed = {"_arguments": arguments}
    return {"function": {"index": index, "name": name, "arguments": parsed}}


def _vectors(reply: Mapping[str, Any]) -> list[Any]:
    data = reply.get("data")
    if not isinstance(data, list):
        return []
    items = sorted(
        (item for item in data if isinstance(item, Mapping)),
        key=lambda item: (
            item.get("index", 0) if isinstance(item.get("index"), int) else 0
        ),
    )
    return [item.get("embedding") for item in items]
