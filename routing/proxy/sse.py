"""Server-sent events as they pass through: split, inspect usage, strip it."""

from __future__ import annotations

import json
import re
from typing import Any

# The usage block of the final chunk (OpenAI puts `"usage": null` in the others).
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_EVENT_END = re.compile(rb"\r?\n\r?\n")


class EventSplitter:
    """Cut a byte stream into complete SSE events (each with its blank line)."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._pending + data if self._pending else data
        events: list[bytes] = []
        start = 0
        for match in _EVENT_END.finditer(buffer):
            events.append(buffer[start : match.end()])
            start = match.end()
        self._pending = buffer[start:]
        return events

    def rest(self) -> bytes:
        """Bytes after the last complete event (a stream cut short)."""
        rest, self._pending = self._pending, b""
        return rest


def usage_of_event(event: bytes) -> dict[str, Any] | None:
    """Return the usage block carried by an event, if it carries one."""
    if not _USAGE.search(event):
        return None
    data = _data_of(event)
    if data is None:
        return None
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    usage = payload.get("usage") if isinstance(payload, dict) else None
    return usage if isinstance(usage, dict) else None


def is_usage_only(event: bytes) -> bool:
    """Whether an event is the extra usage chunk (usage and no choices)."""
    data = _data_of(event)
    if data is None:
        return False
    try:
        payload = json.loads(data)
    except ValueError:
        return False
    return isinstance(payload, dict) and not payload.get("choices")


def text_of_events(events: list[bytes]) -> int:
    """Count the characters of generated text in chat or completion chunks."""
    total = 0
    for event in events:
        data = _data_of(event)
        if data is None or data == b"[DONE]":
            continue
        try:
            payload = json.loads(data)
        except ValueError:
            continue
        for choice in payload.get("choices") or () if isinstance(payload, dict) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = (
                delta.get("content") if isinstance(delta, dict) else choice.get("text")
            )
            if isinstance(text, str):
                total += len(text)
    return total


def error_event(message: str, code: str) -> bytes:
    """An OpenAI-style error event for a stream that cannot go on."""
    payload = {
        "error": {
            "message": message,
            "type": "server_error",
            "param": None,
            "code": code,
        }
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _data_of(event: bytes) -> bytes | None:
    lines = [
        line[5:].lstrip(b" ")
        for line in event.splitlines()
        if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None
