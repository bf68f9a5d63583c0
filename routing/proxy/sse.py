"""Server-sent events as they pass through: split, inspect usage, strip it.

``StreamRelay`` is what the proxy runs per upstream chunk. Most chunks of a
chat stream are whole events without a usage block; those are passed on as
one slice after two substring searches, with no per-event work. Only a chunk
that carries a usage block (the last one) or CR line endings is split into
events.
"""

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


class StreamRelay:
    """Relay an SSE byte stream event-aligned; note its usage; strip the extra
    usage-only event the client did not ask for."""

    __slots__ = (
        "_keep",
        "_kept",
        "_kept_size",
        "_pending",
        "_text",
        "_wants_usage",
        "usage",
    )

    def __init__(self, wants_usage_chunk: bool, keep_bytes: int) -> None:
        self._wants_usage = wants_usage_chunk
        self._pending = b""
        self._keep = keep_bytes
        self._kept: list[bytes] = []  # to estimate tokens if no usage arrives
        self._kept_size = 0
        self._text = 0  # characters counted once the kept bytes hit the limit
        self.usage: dict[str, Any] | None = None

    def feed(self, data: bytes) -> bytes:
        """Return the complete events of `data` (with what came before) to send."""
        if self._pending:
            data = self._pending + data
        if b"\r" in data:
            return self._feed_events(data)
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._pending = data
            return b""
        cut += 2
        complete, self._pending = data[:cut], data[cut:]
        if b'"usage"' in complete and _USAGE.search(complete):
            events = complete.split(b"\n\n")
            events.pop()  # the empty string after the last separator
            return self._pass_events([event + b"\n\n" for event in events])
        self._keep_text(complete)
        return complete

    def _feed_events(self, data: bytes) -> bytes:
        events: list[bytes] = []
        start = 0
        for match in _EVENT_END.finditer(data):
            events.append(data[start : match.end()])
            start = match.end()
        self._pending = data[start:]
        return self._pass_events(events)

    def _pass_events(self, events: list[bytes]) -> bytes:
        out: list[bytes] = []
        for event in events:
            usage = usage_of_event(event)
            if usage is not None:
                self.usage = usage
                if not self._wants_usage and is_usage_only(event):
                    continue
            out.append(event)
        complete = b"".join(out)
        self._keep_text(complete)
        return complete

    def _keep_text(self, complete: bytes) -> None:
        if self.usage is not None:
            return
        if self._kept_size < self._keep:
            self._kept.append(complete)
            self._kept_size += len(complete)
        else:
            self._text += _text_of_chunk(complete)

    def rest(self) -> bytes:
        """Bytes after the last complete event (a stream cut short)."""
        rest, self._pending = self._pending, b""
        return rest

    def text_length(self) -> int:
        """Characters of generated text relayed (for an estimate of tokens)."""
        return self._text + sum(_text_of_chunk(chunk) for chunk in self._kept)


def _text_of_chunk(chunk: bytes) -> int:
    return text_of_events([event for event in _EVENT_END.split(chunk) if event.strip()])


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


def error_event(message: str, code: str, error_type: str = "server_error") -> bytes:
    """An OpenAI-style error event for a stream that cannot go on."""
    payload = {
        "error": {
            "message": message,
            "type": error_type,
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
