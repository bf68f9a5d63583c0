"""Anthropic's wire format as both directions need it: events, errors, usage."""

from __future__ import annotations

import re
from typing import Any

from gateway.protocols.base import TranslationError, dumps

ANTHROPIC_VERSION = "2023-06-01"

# Anthropic's stop reasons and OpenAI's finish reasons, both ways. The lossy
# ones: "stop_sequence" and "pause_turn" become "stop"; "stop" becomes
# "end_turn" (OpenAI does not say whether a stop sequence matched).
STOP_TO_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
FINISH_TO_STOP = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}

# The error types Anthropic's API answers with, by HTTP status; the SDK picks
# its exception class by status, and clients read the type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    501: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+);base64,(.*)", re.DOTALL)


def error_type_for(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return ERROR_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )


def error_body(status: int, message: str, error_type: str | None = None) -> bytes:
    """Serialise ``{"type": "error", "error": {"type", "message"}}``."""
    return encode(
        {
            "type": "error",
            "error": {"type": error_type or error_type_for(status), "message": message},
        }
    )


def encode(value: Any) -> bytes:
    """Compact UTF-8 JSON."""
    return dumps(value)


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event named after the payload's ``type``."""
    return b"event: " + event["type"].encode() + b"\ndata: " + encode(event) + b"\n\n"


def usage_to_canonical(usage: Any) -> dict[str, Any] | None:
    """Anthropic usage as OpenAI's: prompt tokens include the cached ones."""
    if not isinstance(usage, dict):
        return None
    given = usage.get("input_tokens")
    output = usage.get("output_tokens")
    if not isinstance(given, int) or not isinstance(output, int):
        return None
    cache_read = _count(usage.get("cache_read_input_tokens"))
    cache_write = _count(usage.get("cache_creation_input_tokens"))
    prompt = given + cache_read + cache_write
    canonical: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
    }
    if cache_read or cache_write:
        # cache_write_tokens: OpenAI's name (its SDK's PromptTokensDetails).
        canonical["prompt_tokens_details"] = {
            "cached_tokens": cache_read,
            "cache_write_tokens": cache_write,
        }
    return canonical


def usage_from_canonical(usage: Any) -> dict[str, int]:
    """OpenAI usage as Anthropic's (input tokens exclude the cached ones and
    those written to the cache)."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    prompt = _count(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    cached = min(_count(details.get("cached_tokens")), prompt)
    written = min(_count(details.get("cache_write_tokens")), prompt - cached)
    result = {
        "input_tokens": prompt - cached - written,
        "output_tokens": _count(usage.get("completion_tokens")),
    }
    if cached:
        result["cache_read_input_tokens"] = cached
    if written:
        result["cache_creation_input_tokens"] = written
    return result


def image_source_from_url(url: str, where: str) -> dict[str, Any]:
    """An OpenAI image URL (http(s) or a base64 data URL) as an Anthropic source."""
    match = _DATA_URL.fullmatch(url)
    if match is not None:
        return {"type": "base64", "media_type": match[1], "data": match[2]}
    if url.startswith(("https://", "http://")):
        return {"type": "url", "url": url}
    raise TranslationError(
        400,
        f"{where}: an image must be an http(s) URL or a base64 data URL "
        "('data:image/png;base64,...').",
        param=where,
    )


def image_url_from_source(source: Any, where: str) -> str:
    """An Anthropic image source as an OpenAI image URL."""
    if isinstance(source, dict):
        kind = source.get("type")
        if kind == "base64":
            media_type, data = source.get("media_type"), source.get("data")
            if isinstance(media_type, str) and isinstance(data, str):
                return f"data:{media_type};base64,{data}"
        elif kind == "url" and isinstance(source.get("url"), str):
            return str(source["url"])
    raise TranslationError(
        400,
        f"{where}.source: expected {{'type': 'base64', 'media_type', 'data'}} or "
        "{'type': 'url', 'url'}.",
        param=f"{where}.source",
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0
