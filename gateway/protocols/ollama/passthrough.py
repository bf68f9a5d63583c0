"""Native Ollama replies passed through to an Ollama backend: their usage.

When the backend is Ollama itself the reply is relayed untouched;
``usage_of_native`` reads the canonical usage of a native reply (or the final
line of a stream), and ``NativeStreamUsage`` watches a native NDJSON stream as
it is relayed, for its usage, its errors and the length of its text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# A stream line longer than this is not a usage line worth keeping for.
MAX_NATIVE_LINE = 1024 * 1024


def usage_of_native(reply: Any) -> dict[str, int] | None:
    """Canonical usage from a native Ollama reply (or final stream line), or None."""
    if not isinstance(reply, Mapping):
        return None
    prompt = _count(reply.get("prompt_eval_count"))
    completion = _count(reply.get("eval_count"))
    if prompt is None and completion is None:
        return None
    prompt = prompt or 0
    completion = completion or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class NativeStreamUsage:
    """Watch a native NDJSON stream as it is relayed, for its usage and errors.

    Only the last, unfinished line is held (up to ``MAX_NATIVE_LINE`` bytes);
    the text of ``message.content`` / ``response`` is counted for estimates.
    """

    def __init__(self) -> None:
        self._tail = b""
        self.usage: dict[str, int] | None = None
        self.error: str | None = None
        self.done = False
        self.text_chars = 0

    def feed(self, data: bytes) -> None:
        lines = (self._tail + data).split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > MAX_NATIVE_LINE:
            self._tail = b""
        for line in lines:
            self._read(line)

    def close(self) -> None:
        """The stream ended: read a last line that had no newline."""
        tail, self._tail = self._tail, b""
        if tail.strip():
            self._read(tail)

    def _read(self, line: bytes) -> None:
        try:
            value = json.loads(line)
        except ValueError:
            return
        if not isinstance(value, Mapping):
            return
        error = value.get("error")
        if isinstance(error, str):
            self.error = error
            return
        message = value.get("message")
        text = message.get("content") if isinstance(message, Mapping) else None
        if text is None:
            text = value.get("response")
        if isinstance(text, str):
            self.text_chars += len(text)
        if value.get("done") is True:
            self.done = True
            usage = usage_of_native(value)
            if usage is not None:
                self.usage = usage
