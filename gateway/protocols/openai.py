"""OpenAI chat completions, the canonical form itself: its stream on both ends.

A backend that speaks OpenAI's chat API already streams canonical chunks
(``ChatChunkReader`` only looks for an error); an OpenAI client served by a
backend of another protocol gets the canonical chunks written as OpenAI's
server-sent events (``ChatStreamWriter``).
"""

from __future__ import annotations

from typing import Any

from gateway.protocols.base import BROKEN, BUDGET, StreamFailed, dumps
from gateway.protocols.prompt_cache import usage_with_cache_timings

DONE = b"data: [DONE]\n\n"


def chat_event(chunk: dict[str, Any]) -> bytes:
    """One ``data:`` event."""
    return b"data: " + dumps(chunk) + b"\n\n"


def error_message(body: Any) -> str | None:
    """The message of an OpenAI-shaped error body, if it is one."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error  # Ollama's and some servers' {"error": "..."}
    return None


class ChatChunkReader:
    """Chunks of an OpenAI chat stream, already canonical; errors raise.

    llama.cpp's cached prompt tokens (``timings.cache_n`` beside the usage)
    are moved into the usage block, where canonical usage keeps them.
    """

    __slots__ = ()

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in event and "choices" not in event:
            message = error_message(event) or "unknown error"
            raise StreamFailed(f"the backend reported an error: {message}")
        if "timings" in event or "tokens_cached" in event:
            usage = usage_with_cache_timings(event)
            if usage is not None:
                event = {**event, "usage": usage}
        return [event]

    def finish(self) -> list[dict[str, Any]]:
        return []


class ChatStreamWriter:
    """Canonical chunks out as OpenAI's stream, ``data: [DONE]`` at the end.

    The usage-only chunk is written only when the client asked for it
    (``stream_options.include_usage``), as OpenAI does.
    """

    __slots__ = ("_wants_usage",)

    def __init__(self, wants_usage: bool) -> None:
        self._wants_usage = wants_usage

    def feed(self, event: dict[str, Any]) -> list[bytes]:
        if not event.get("choices") and not self._wants_usage:
            return []
        return [chat_event(event)]

    def finish(self) -> list[bytes]:
        return [DONE]

    def fail(self, message: str, code: str = BROKEN) -> list[bytes]:
        error = {
            "message": message,
            "type": "insufficient_quota" if code == BUDGET else "server_error",
            "param": None,
            "code": code,
        }
        return [chat_event({"error": error})]
