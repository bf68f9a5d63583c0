"""Canonical chunks -> Ollama NDJSON lines, as they come.

``OllamaStreamTranslator`` writes ``chat.completion.chunk`` events as the lines
of a streamed ``/api/chat`` or ``/api/generate`` reply; tool calls go out
whole, once their arguments are complete, because Ollama's arguments are an
object. A stream that breaks off ends with an error line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.protocols.base import BROKEN, dumps
from gateway.protocols.ollama.replies import (
    done_fields,
    error_body,
    native_call,
    timestamp,
)

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


@dataclass(slots=True)
class _PendingCall:
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class OllamaStreamTranslator:
    """Turn canonical chunks into Ollama NDJSON lines (``/api/chat`` or generate).

    ``clock`` gives wall time (``created_at``), ``ticks`` monotonic nanoseconds
    (the durations of the final line); both are injectable for tests.
    """

    def __init__(
        self,
        path: Literal["/api/chat", "/api/generate"],
        model: str,
        *,
        clock: Callable[[], float] = time.time,
        ticks: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._chat = path == "/api/chat"
        self._model = model
        self._clock = clock
        self._ticks = ticks
        self._started = ticks()
        self._first_token: int | None = None
        self._calls: dict[int, _PendingCall] = {}
        self._finish: str | None = None
        self._usage: Any = None

    def feed(self, event: dict[str, Any]) -> list[bytes]:
        usage = event.get("usage")
        if isinstance(usage, Mapping):
            self._usage = usage
        choices = event.get("choices")
        if not isinstance(choices, list):
            return []
        out: list[bytes] = []
        for choice in choices:
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, Mapping):
                text = delta.get("content")
                thinking = delta.get("reasoning_content")
                if (isinstance(text, str) and text) or (
                    isinstance(thinking, str) and thinking
                ):
                    out.append(self._text_line(text, thinking))
                calls = delta.get("tool_calls")
                if isinstance(calls, list):
                    self._add_calls(calls)
            finish = choice.get("finish_reason")
            if isinstance(finish, str) and finish:
                self._finish = finish
                out += self._flush_calls()
        return out

    def finish(self) -> list[bytes]:
        out = self._flush_calls()
        now = self._ticks()
        head = self._head()
        if self._chat:
            head["message"] = {"role": "assistant", "content": ""}
        else:
            head["response"] = ""
        head.update(done_fields(self._finish, self._usage, now - self._started))
        first = self._first_token if self._first_token is not None else now
        head["prompt_eval_duration"] = first - self._started
        head["eval_duration"] = now - first
        out.append(_line(head))
        return out

    def fail(self, message: str, code: str = BROKEN) -> list[bytes]:
        # Ollama's errors are a message only.
        return [error_body(message) + b"\n"]

    def _head(self) -> dict[str, Any]:
        return {"model": self._model, "created_at": timestamp(self._clock())}

    def _text_line(self, text: Any, thinking: Any) -> bytes:
        if self._first_token is None:
            self._first_token = self._ticks()
        line = self._head()
        text = text if isinstance(text, str) else ""
        if self._chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if isinstance(thinking, str) and thinking:
                message["thinking"] = thinking
            line["message"] = message
        else:
            line["response"] = text
            if isinstance(thinking, str) and thinking:
                line["thinking"] = thinking
        line["done"] = False
        return _line(line)

    def _add_calls(self, calls: list[Any]) -> None:
        for call in calls:
            if not isinstance(call, Mapping):
                continue
            position = call.get("index", 0)
            pending = self._calls.setdefault(
                position if isinstance(position, int) else 0, _PendingCall()
            )
            function = call.get("function")
            if not isinstance(function, Mapping):
                continue
            name = function.get("name")
            if not pending.name and isinstance(name, str):
                pending.name = name
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                pending.arguments.append(arguments)
            elif isinstance(arguments, Mapping):
                pending.arguments.append(_ENCODER.encode(arguments))

    def _flush_calls(self) -> list[bytes]:
        if not self._calls or not self._chat:
            self._calls.clear()
            return []
        calls = [
            native_call(index, pending.name, "".join(pending.arguments))
            for index, pending in sorted(self._calls.items())
        ]
        self._calls.clear()
        if self._first_token is None:
            self._first_token = self._ticks()
        line = self._head()
        line["message"] = {"role": "assistant", "content": "", "tool_calls": calls}
        line["done"] = False
        return [_line(line)]


def _line(value: dict[str, Any]) -> bytes:
    return dumps(value) + b"\n"
