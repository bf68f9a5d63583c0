"""Anthropic's stream events, both ways, as they come.

``MessageStreamWriter`` writes canonical ``chat.completion.chunk`` dicts as the
events of a streamed Message, for Anthropic clients; ``MessageStreamReader``
reads an Anthropic backend's events back into chunks. The two share the event
grammar (``message_start``, content block start / delta / stop,
``message_delta``, ``message_stop``, ``error``).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.protocols.anthropic.inbound import message_id
from gateway.protocols.anthropic.outbound import completion_id
from gateway.protocols.anthropic.wire import (
    FINISH_TO_STOP,
    STOP_TO_FINISH,
    error_type_for,
    sse_event,
    usage_from_canonical,
    usage_to_canonical,
)
from gateway.protocols.base import BROKEN, BUDGET, StreamFailed


class MessageStreamWriter:
    """Canonical chunks in, Anthropic's stream events out, as they come.

    The events are the API's: ``message_start``, a ``ping``, then per content
    block ``content_block_start`` / ``content_block_delta`` (``text_delta``,
    ``input_json_delta``) / ``content_block_stop``, then ``message_delta``
    (stop reason, usage) and ``message_stop``. Chat streams report usage at
    their end, so ``message_start`` carries 0 input tokens and ``message_delta``
    the real counts (the SDK takes both from there).
    """

    __slots__ = (
        "_block",
        "_finish",
        "_id",
        "_index",
        "_model",
        "_started",
        "_tools",
        "_usage",
    )

    def __init__(self, model: str) -> None:
        self._model = model
        self._id = "msg_nexus"
        self._started = False
        self._index = -1  # the last block opened (-1: none yet)
        self._block = ""  # "text" or "tool_use" while that block is open
        self._tools: dict[int, int] = {}  # tool call index -> block index
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def feed(self, event: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if not self._started:
            self._id = message_id(event.get("id"))
            out += self._start()
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = event.get("choices")
        if not isinstance(choices, list):
            return out
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                text = delta.get("content")
                if isinstance(text, str) and text:
                    if self._block != "text":
                        out += self._open({"type": "text", "text": ""}, "text")
                    out.append(
                        _delta(self._index, {"type": "text_delta", "text": text})
                    )
                for call in delta.get("tool_calls") or ():
                    if isinstance(call, dict):
                        out += self._tool_delta(call)
            finish = choice.get("finish_reason")
            if isinstance(finish, str):
                self._finish = finish
        return out

    def finish(self) -> list[bytes]:
        out = [] if self._started else self._start()
        out += self._close()
        usage = usage_from_canonical(self._usage)
        stop = FINISH_TO_STOP.get(self._finish or "stop", "end_turn")
        out.append(
            sse_event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": usage,
                }
            )
        )
        out.append(sse_event({"type": "message_stop"}))
        return out

    def fail(self, message: str, code: str = BROKEN) -> list[bytes]:
        # Anthropic's errors have a type and no code: a budget cut is a 429's.
        status = 429 if code == BUDGET else 502
        return [
            sse_event(
                {
                    "type": "error",
                    "error": {"type": error_type_for(status), "message": message},
                }
            )
        ]

    def _start(self) -> list[bytes]:
        self._started = True
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [
            sse_event({"type": "message_start", "message": message}),
            sse_event({"type": "ping"}),
        ]

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        position = call.get("index", 0)
        position = position if isinstance(position, int) else 0
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        index = self._tools.get(position)
        if index is None:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_nexus_{position}",
                "name": function.get("name") or "",
                "input": {},
            }
            out += self._open(block, "tool_use")
            index = self._tools[position] = self._index
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            out.append(_delta(index, delta))
        return out

    def _open(self, block: dict[str, Any], kind: str) -> list[bytes]:
        out = self._close()
        self._index += 1
        self._block = kind
        out.append(
            sse_event(
                {
                    "type": "content_block_start",
                    "index": self._index,
                    "content_block": block,
                }
            )
        )
        return out

    def _close(self) -> list[bytes]:
        if not self._block:
            return []
        self._block = ""
        return [sse_event({"type": "content_block_stop", "index": self._index})]


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return sse_event({"type": "content_block_delta", "index": index, "delta": delta})


class MessageStreamReader:
    """Anthropic's stream events in, canonical chunks out, as they come.

    Text deltas become ``content`` deltas; each ``tool_use`` block becomes a
    tool call (its id and name when the block starts, then its
    ``input_json_delta`` fragments as ``arguments``); thinking blocks are
    left out. ``message_stop`` gives the chunk with the finish reason and the
    usage-only chunk (input tokens from ``message_start``, output tokens from
    ``message_delta``). An ``error`` event, or an end without ``message_stop``,
    raises StreamFailed.
    """

    __slots__ = ("_created", "_done", "_finish", "_id", "_model", "_tools", "_usage")

    def __init__(self, created: int = 0) -> None:
        self._created = created
        self._id = "chatcmpl-nexus"
        self._model: Any = None
        self._tools: dict[int, int] = {}  # block index -> tool call index
        self._usage: dict[str, Any] = {}
        self._finish = "stop"
        self._done = False

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        kind = event.get("type")
        if kind == "content_block_delta":
            delta = event.get("delta")
            if not isinstance(delta, dict):
                return []
            if delta.get("type") == "text_delta":
                text = delta.get("text")
                return [self._chunk({"content": text})] if text else []
            if delta.get("type") == "input_json_delta":
                position = self._tools.get(event.get("index", -1))
                partial = delta.get("partial_json")
                if position is None or not partial:
                    return []
                call = {"index": position, "function": {"arguments": partial}}
                return [self._chunk({"tool_calls": [call]})]
            return []
        if kind == "content_block_start":
            return self._block_start(event)
        if kind == "message_start":
            message = event.get("message")
            message = message if isinstance(message, dict) else {}
            self._id = completion_id(message.get("id"))
            self._model = message.get("model")
            if isinstance(message.get("usage"), dict):
                self._usage.update(message["usage"])
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "message_delta":
            delta = event.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason"):
                self._finish = STOP_TO_FINISH.get(delta["stop_reason"], "stop")
            usage = event.get("usage")
            if isinstance(usage, dict):
                self._usage.update({k: v for k, v in usage.items() if v is not None})
            return []
        if kind == "message_stop":
            self._done = True
            last = self._chunk({}, finish=self._finish)
            usage = usage_to_canonical(self._usage)
            if usage is None:
                return [last]
            tail = self._chunk({})
            tail["choices"] = []
            tail["usage"] = usage
            return [last, tail]
        if kind == "error":
            error = event.get("error")
            message = error.get("message") if isinstance(error, dict) else None
            raise StreamFailed(f"the backend reported an error: {message or event}")
        return []  # ping, content_block_stop, and events added later

    def finish(self) -> list[dict[str, Any]]:
        if not self._done:
            raise StreamFailed("the backend's stream ended before message_stop")
        return []

    def _block_start(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        block = event.get("content_block")
        if not isinstance(block, dict):
            return []
        if block.get("type") == "text" and block.get("text"):
            return [self._chunk({"content": block["text"]})]
        if block.get("type") != "tool_use":
            return []
        position = self._tools[event.get("index", -1)] = len(self._tools)
        given = block.get("input")
        call = {
            "index": position,
            "id": block.get("id"),
            "type": "function",
            "function": {
                "name": block.get("name"),
                "arguments": json.dumps(given) if given else "",
            },
        }
        return [self._chunk({"tool_calls": [call]})]

    def _chunk(
        self, delta: dict[str, Any], finish: str | None = None
    ) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
