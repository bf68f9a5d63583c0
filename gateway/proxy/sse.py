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

import orjson

from gateway.protocols.prompt_cache import usage_with_cache_timings

# The usage block of the final chunk (OpenAI puts `"usage": null` in the others).
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_EVENT_END = re.compile(rb"\r?\n\r?\n")


class EventSplitter:
    """Cut a byte stream into complete SSE events (each with its blank line).

    Linear in the bytes fed: an incomplete event is kept as a list of chunks,
    and only each new chunk (with the three bytes before it) is searched for
    the end of an event.
    """

    __slots__ = ("_parts", "pending_size")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self.pending_size = 0  # bytes of the event not yet complete

    def feed(self, data: bytes) -> list[bytes]:
        parts = self._parts
        if parts:
            probe = parts[-1][-3:] + data
            if b"\n\n" not in probe and b"\n\r\n" not in probe:
                parts.append(data)
                self.pending_size += len(data)
                return []
            parts.append(data)
            buffer = b"".join(parts)
            parts.clear()
        else:
            buffer = data
        events: list[bytes] = []
        start = 0
        for match in _EVENT_END.finditer(buffer):
            events.append(buffer[start : match.end()])
            start = match.end()
        if start < len(buffer):
            parts.append(buffer[start:])
        self.pending_size = len(buffer) - start
        return events

    def rest(self) -> bytes:
        """Bytes after the last complete event (a stream cut short)."""
        rest = b"".join(self._parts)
        self._parts.clear()
        self.pending_size = 0
        return rest

    def peek(self) -> bytes:
        """Bytes of the event not yet complete."""
        return b"".join(self._parts)


class EventTooLarge(Exception):
    """An event grew past the relay's limit without ending (no blank line)."""


class LineSplitter:
    """Cut a byte stream into complete NDJSON lines (each with its newline).

    Linear in the bytes fed, like EventSplitter: a line not yet complete is
    kept as a list of chunks until one brings its newline.
    """

    __slots__ = ("_parts", "pending_size")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self.pending_size = 0  # bytes of the line not yet complete

    def feed(self, data: bytes) -> list[bytes]:
        end = data.rfind(b"\n") + 1
        if not end:
            if data:
                self._parts.append(data)
                self.pending_size += len(data)
            return []
        head = data[:end]
        if self._parts:
            head = b"".join(self._parts) + head
            self._parts.clear()
        rest = data[end:]
        if rest:
            self._parts.append(rest)
        self.pending_size = len(rest)
        return [line + b"\n" for line in head[:-1].split(b"\n")]

    def rest(self) -> bytes:
        """Bytes after the last complete line (a stream cut short)."""
        rest = b"".join(self._parts)
        self._parts.clear()
        self.pending_size = 0
        return rest

    def peek(self) -> bytes:
        """Bytes of the line not yet complete."""
        return b"".join(self._parts)


class InvalidEvent(Exception):
    """A data event that is neither a JSON object nor ``[DONE]``.

    ``before``: what the relay passes on of the events ahead of it in the same
    chunk (valid, already counted for usage).
    """

    def __init__(self, before: bytes) -> None:
        super().__init__("a stream event that is not a JSON object")
        self.before = before


def event_payload(event: bytes) -> dict[str, Any] | None:
    """The JSON object an event's data holds; None for an event without data
    (a comment, a keep-alive) or ``[DONE]``.

    Raises ValueError if the data is anything else. orjson first (a
    microsecond for a chat chunk); what it refuses but JSON allows (integers
    past 64 bits) goes through the standard library.
    """
    body = event.rstrip(b"\r\n")
    if body.startswith(b"data:") and b"\n" not in body:
        data: bytes | None = body[5:].strip()  # one data line: the usual chunk
    else:
        data = _data_of(body)
    if data is None or data == b"[DONE]":
        return None
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            payload = json.loads(data)
        except RecursionError:
            raise ValueError("nested too deep") from None
    if isinstance(payload, dict):
        return payload
    raise ValueError("not a JSON object")


class StreamRelay:
    """Relay an SSE byte stream event-aligned; note its usage; strip the extra
    usage-only event the client did not ask for.

    Work is linear in the bytes received: an event still incomplete is kept as
    a list of chunks, and only each new chunk (with the three bytes before it,
    where a split separator could start) is searched for the end of an event.
    An event over `max_event` bytes raises EventTooLarge; a data event that is
    not a JSON object (nor ``[DONE]``) raises InvalidEvent, so that the client
    never gets bytes its SDK cannot parse as if the backend had sent them.
    """

    __slots__ = (
        "_keep",
        "_kept",
        "_kept_size",
        "_max_event",
        "_parts",
        "_parts_size",
        "_text",
        "_wants_usage",
        "broken",
        "usage",
    )

    def __init__(
        self, wants_usage_chunk: bool, keep_bytes: int, max_event: int = 1 << 20
    ) -> None:
        self._wants_usage = wants_usage_chunk
        self._parts: list[bytes] = []  # the incomplete event so far
        self._parts_size = 0
        self._max_event = max_event
        self._keep = keep_bytes
        self._kept: list[bytes] = []  # to estimate tokens if no usage arrives
        self._kept_size = 0
        self._text = 0  # characters counted once the kept bytes hit the limit
        self.usage: dict[str, Any] | None = None
        # Set by the caller: an invalid event came right after the first ones.
        self.broken = False

    def feed(self, data: bytes) -> bytes:
        """Return the complete events of `data` (with what came before) to send."""
        parts = self._parts
        if parts:
            probe = parts[-1][-3:] + data
            if b"\n\n" not in probe and b"\n\r\n" not in probe:
                self._hold(data)
                return b""
            parts.append(data)
            data = b"".join(parts)
            parts.clear()
            self._parts_size = 0
        if b"\r" in data:
            return self._feed_events(data)
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._hold(data)
            return b""
        cut += 2
        complete = data[:cut]
        if cut < len(data):
            self._hold(data[cut:])
        events = complete.split(b"\n\n")
        events.pop()  # the empty string after the last separator
        payloads = self._payloads(events, b"\n\n")
        if b'"usage"' in complete and _USAGE.search(complete):
            return self._pass_events([event + b"\n\n" for event in events])
        self._keep_text(complete, payloads)
        return complete

    def _payloads(
        self, events: list[bytes], separator: bytes
    ) -> list[dict[str, Any] | None]:
        """Each event's JSON object (parsed once: checked, then counted); raise
        InvalidEvent, with the events before it, at one that is not valid."""
        payloads: list[dict[str, Any] | None] = []
        for index, event in enumerate(events):
            try:
                payloads.append(event_payload(event))
            except ValueError:
                before = [event + separator for event in events[:index]]
                raise InvalidEvent(self._pass_events(before)) from None
        return payloads

    def _hold(self, data: bytes) -> None:
        self._parts.append(data)
        self._parts_size += len(data)
        if self._parts_size > self._max_event:
            self._parts.clear()
            self._parts_size = 0
            raise EventTooLarge(self._max_event)

    def _feed_events(self, data: bytes) -> bytes:
        events: list[bytes] = []
        start = 0
        for match in _EVENT_END.finditer(data):
            events.append(data[start : match.end()])
            start = match.end()
        if start < len(data):
            self._hold(data[start:])
        self._payloads(events, b"")
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

    def _keep_text(
        self, complete: bytes, payloads: list[dict[str, Any] | None] | None = None
    ) -> None:
        if self.usage is not None:
            return
        if self._kept_size < self._keep:
            self._kept.append(complete)
            self._kept_size += len(complete)
        elif payloads is not None:
            self._text += sum(text_of_chunk(p) for p in payloads if p is not None)
        else:
            self._text += _text_of_chunk(complete)

    def rest(self) -> bytes:
        """Bytes after the last complete event (a stream cut short)."""
        rest = b"".join(self._parts)
        self._parts.clear()
        self._parts_size = 0
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
    # With llama.cpp's cached prompt tokens (timings.cache_n) folded in.
    return usage_with_cache_timings(payload) if isinstance(payload, dict) else None


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
        if isinstance(payload, dict):
            total += text_of_chunk(payload)
    return total


def text_of_chunk(payload: dict[str, Any]) -> int:
    """Characters of generated text in one parsed chat or completion chunk."""
    total = 0
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(text, str):
            total += len(text)
    return total


def counted_events(complete: bytes) -> list[tuple[bytes, int]]:
    """Complete events (as ``StreamRelay.feed`` returns them), each with the
    characters of generated text it carries."""
    pieces: list[tuple[bytes, int]] = []
    start = 0
    for match in _EVENT_END.finditer(complete):
        event = complete[start : match.end()]
        pieces.append((event, text_of_events([event])))
        start = match.end()
    if start < len(complete):
        pieces.append((complete[start:], 0))
    return pieces


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
