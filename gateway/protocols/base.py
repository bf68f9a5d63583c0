"""What every translator shares: its error, the shape of a stream translator, JSON."""

from __future__ import annotations

import json
from typing import Any, Protocol

import orjson


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, fast (orjson).

    What orjson refuses (integers past 64 bits, lone surrogates from ``\\ud800``
    escapes, non-string keys) goes through the standard library, ASCII-escaped.
    """
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode()


def loads(data: bytes | str) -> Any:
    """Parse JSON (orjson); raises ValueError on anything that is not JSON.

    What orjson refuses but JSON allows (a lone surrogate escape such as
    ``"\\ud800"``) is parsed by the standard library, as on the OpenAI surface,
    so such a request is routed (and counted) like any other.
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


class TranslationError(Exception):
    """A request the target protocol cannot express, or a malformed one.

    ``status`` is the HTTP status the client gets (400 for bad input, 422 or 501
    for something valid that the target cannot do); the surface renders
    ``message``, ``param`` and ``code`` in its own error shape.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


# Why a stream is failed (StreamTranslator.fail's code).
BROKEN = "upstream_stream_broken"
BUDGET = "budget_exceeded"


class StreamTranslator(Protocol):
    """An incremental translator of one stream: never buffers a whole answer.

    ``feed`` takes one parsed event of the source protocol and returns the bytes
    to send for it (zero or more wire events, each complete: SSE events with
    their blank line, or NDJSON lines with their newline). ``finish`` is called
    once when the source ended normally, ``fail`` once when it broke off; both
    return the closing events (usage, stop reason, the protocol's error event).
    ``fail``'s ``code`` is ``BROKEN`` (the backend failed) or ``BUDGET`` (the
    gateway cut the stream: the key's budget ran out).
    """

    def feed(self, event: dict[str, Any]) -> list[bytes]: ...

    def finish(self) -> list[bytes]: ...

    def fail(self, message: str, code: str = ...) -> list[bytes]: ...


class StreamFailed(Exception):
    """The source stream reported an error, or ended before its last event.

    Raised by a ``ChunkReader``; the proxy ends the client's stream with the
    client protocol's error event (``StreamTranslator.fail``) carrying
    ``message``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ChunkReader(Protocol):
    """An incremental reader of a backend's stream into canonical chunks.

    ``feed`` takes one parsed event of the backend's protocol and returns the
    ``chat.completion.chunk`` dicts it stands for (zero or more); ``finish`` is
    called once when the backend's stream ended and returns the last ones (the
    finish reason, the usage-only chunk). Both raise ``StreamFailed`` when the
    backend reported an error or stopped short of its protocol's last event.
    """

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...
