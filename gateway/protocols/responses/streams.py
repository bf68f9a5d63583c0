"""Canonical chat completions chunks -> a Responses event stream.

``ResponsesStreamTranslator`` turns ``chat.completion.chunk`` events into the
SSE events of a streamed response as they arrive (``response.created``, item,
part and delta events, their ``.done`` events, then ``response.completed`` or
``response.incomplete``), and a stream that breaks off into an ``error`` event
and ``response.failed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.protocols.base import BROKEN, BUDGET, dumps
from gateway.protocols.responses.replies import (
    INCOMPLETE_REASONS,
    Outcome,
    function_call_item,
    message_item,
    output_text,
    response_object,
    usage_of_chat,
)


@dataclass(slots=True)
class _Call:
    """One function call being streamed."""

    output_index: int
    item_id: str
    call_id: str | None
    name: str
    arguments: list[str] = field(default_factory=list)
    announced: bool = False


class ResponsesStreamTranslator:
    """Turn a canonical chunk stream into a Responses event stream, incrementally.

    Text deltas and argument deltas go out as they come; the text and arguments
    are also kept, because the protocol's ``.done`` events and the final
    ``response.completed`` repeat them whole.
    """

    def __init__(
        self, request: Mapping[str, Any], *, response_id: str, created_at: int
    ) -> None:
        self._request = request
        self._id = response_id
        self._created_at = created_at
        self._sequence = 0
        self._started = False
        self._model: str | None = None
        self._output: list[dict[str, Any]] = []  # finished items, by output index
        self._next_index = 0
        self._text: list[str] | None = None  # the open message item's text
        self._text_index = 0
        self._text_item = ""
        self._calls: dict[int, _Call] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def feed(self, event: dict[str, Any]) -> list[bytes]:
        out = self._start()
        model = event.get("model")
        if self._model is None and isinstance(model, str) and model:
            self._model = model
        usage = usage_of_chat(event.get("usage"))
        if usage is not None:
            self._usage = usage
        choices = event.get("choices")
        if not isinstance(choices, list):
            return out
        for choice in choices:
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, Mapping):
                content = delta.get("content")
                if isinstance(content, str) and content:
                    out += self._text_delta(content)
                calls = delta.get("tool_calls")
                if isinstance(calls, list):
                    for call in calls:
                        if isinstance(call, Mapping):
                            out += self._call_delta(call)
            finish = choice.get("finish_reason")
            if isinstance(finish, str) and finish:
                self._finish = finish
        return out

    def finish(self) -> list[bytes]:
        out = self._start()
        out += self._close_items()
        reason = INCOMPLETE_REASONS.get(self._finish or "")
        status = "incomplete" if reason else "completed"
        response = self._snapshot(status, incomplete_reason=reason)
        out.append(self._event(f"response.{status}", {"response": response}))
        return out

    def fail(self, message: str, code: str = BROKEN) -> list[bytes]:
        code = code if code == BUDGET else "server_error"
        out = self._start()
        out += self._close_items(status="incomplete")
        out.append(
            self._event("error", {"code": code, "message": message, "param": None})
        )
        response = self._snapshot("failed", error={"code": code, "message": message})
        out.append(self._event("response.failed", {"response": response}))
        return out

    # Items

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        response = self._snapshot("in_progress", usage=False)
        return [
            self._event("response.created", {"response": response}),
            self._event("response.in_progress", {"response": response}),
        ]

    def _text_delta(self, content: str) -> list[bytes]:
        out: list[bytes] = []
        if self._text is None:
            self._text = []
            self._text_index = self._take_index()
            self._text_item = f"msg_{self._id}_{self._text_index}"
            item = message_item(self._text_item, [], "in_progress")
            out.append(self._item_event("added", self._text_index, item))
            out.append(
                self._event(
                    "response.content_part.added",
                    {
                        "item_id": self._text_item,
                        "output_index": self._text_index,
                        "content_index": 0,
                        "part": output_text(""),
                    },
                )
            )
        self._text.append(content)
        out.append(
            self._event(
                "response.output_text.delta",
                {
                    "item_id": self._text_item,
                    "output_index": self._text_index,
                    "content_index": 0,
                    "delta": content,
                    "logprobs": [],
                },
            )
        )
        return out

    def _call_delta(self, delta: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        position = delta.get("index", 0)
        if not isinstance(position, int):
            position = 0
        function = delta.get("function")
        if not isinstance(function, Mapping):
            function = {}
        call = self._calls.get(position)
        if call is None:
            # A message item before a call is finished: items do not interleave.
            out += self._close_text()
            index = self._take_index()
            call = self._calls[position] = _Call(
                output_index=index,
                item_id=f"fc_{self._id}_{index}",
                call_id=None,
                name="",
            )
        call_id = delta.get("id")
        if call.call_id is None and isinstance(call_id, str) and call_id:
            call.call_id = call_id
        name = function.get("name")
        if not call.name and isinstance(name, str) and name:
            call.name = name
        arguments = function.get("arguments")
        piece = arguments if isinstance(arguments, str) else ""
        if not call.announced and call.name:
            call.announced = True
            call.call_id = call.call_id or f"call_{call.item_id}"
            item = function_call_item(
                call.item_id, call.call_id, call.name, "", "in_progress"
            )
            out.append(self._item_event("added", call.output_index, item))
            # Arguments that came before the name are sent now, in one delta.
            piece = "".join(call.arguments) + piece
            call.arguments.clear()
            if piece:
                call.arguments.append(piece)
                out.append(self._arguments_delta(call, piece))
            return out
        if piece:
            call.arguments.append(piece)
            if call.announced:
                out.append(self._arguments_delta(call, piece))
        return out

    def _arguments_delta(self, call: _Call, piece: str) -> bytes:
        return self._event(
            "response.function_call_arguments.delta",
            {
                "item_id": call.item_id,
                "output_index": call.output_index,
                "delta": piece,
            },
        )

    def _close_text(self, status: str = "completed") -> list[bytes]:
        if self._text is None:
            return []
        text = "".join(self._text)
        self._text = None
        part = output_text(text)
        item = message_item(self._text_item, [part], status)
        self._store(self._text_index, item)
        where = {"item_id": self._text_item, "output_index": self._text_index}
        return [
            self._event(
                "response.output_text.done",
                {**where, "content_index": 0, "text": text, "logprobs": []},
            ),
            self._event(
                "response.content_part.done",
                {**where, "content_index": 0, "part": part},
            ),
            self._item_event("done", self._text_index, item),
        ]

    def _close_items(self, status: str = "completed") -> list[bytes]:
        out = self._close_text(status)
        for call in sorted(self._calls.values(), key=lambda c: c.output_index):
            arguments = "".join(call.arguments)
            if not call.announced:
                # A call whose name never came: still report what there is.
                call.announced = True
                call.call_id = call.call_id or f"call_{call.item_id}"
                item = function_call_item(
                    call.item_id, call.call_id, call.name, "", "in_progress"
                )
                out.append(self._item_event("added", call.output_index, item))
                if arguments:
                    out.append(self._arguments_delta(call, arguments))
            item = function_call_item(
                call.item_id, call.call_id, call.name, arguments, status
            )
            self._store(call.output_index, item)
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    {
                        "item_id": call.item_id,
                        "output_index": call.output_index,
                        "name": call.name,
                        "arguments": arguments,
                    },
                )
            )
            out.append(self._item_event("done", call.output_index, item))
        self._calls.clear()
        return out

    def _take_index(self) -> int:
        index = self._next_index
        self._next_index += 1
        return index

    def _store(self, index: int, item: dict[str, Any]) -> None:
        while len(self._output) <= index:
            self._output.append({})
        self._output[index] = item

    # Wire

    def _snapshot(
        self,
        status: str,
        *,
        usage: bool = True,
        incomplete_reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        outcome = Outcome(
            status,
            [item for item in self._output if item],
            self._usage if usage else None,
            incomplete_reason,
            error,
        )
        return response_object(
            self._request, self._id, self._created_at, self._model, outcome
        )

    def _item_event(self, which: str, index: int, item: dict[str, Any]) -> bytes:
        return self._event(
            f"response.output_item.{which}", {"output_index": index, "item": item}
        )

    def _event(self, kind: str, body: dict[str, Any]) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **body}
        self._sequence += 1
        return b"event: %b\ndata: %b\n\n" % (
            kind.encode(),
            dumps(payload),
        )
