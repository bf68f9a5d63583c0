"""OpenAI's Responses API <-> the canonical form (chat completions), stateless.

Three pieces, each pure:

- ``responses_to_chat(body)``: a ``POST /v1/responses`` body -> a canonical chat
  completions request. ``instructions`` becomes the first system message;
  ``input`` (a string, or items: messages with ``input_text`` / ``input_image`` /
  ``output_text`` parts, ``function_call`` and ``function_call_output`` items)
  becomes ``messages``; function ``tools``, ``tool_choice``,
  ``parallel_tool_calls``, ``max_output_tokens`` (as ``max_tokens``),
  ``temperature``, ``top_p``, ``user`` and ``text.format`` (as
  ``response_format``) are mapped. Reasoning items from earlier turns are dropped
  (a chat backend cannot take them back).
- ``chat_to_response(reply, request, ...)``: a ``chat.completion`` -> a
  ``response`` object (a ``message`` item with ``output_text``, one
  ``function_call`` item per tool call, ``usage`` in input/output tokens;
  ``finish_reason`` ``length`` makes it ``incomplete`` with reason
  ``max_output_tokens``).
- ``ResponsesStreamTranslator``: ``chat.completion.chunk`` events -> the SSE
  events of a streamed response, as they arrive: ``response.created``,
  ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta`` ...,
  ``response.function_call_arguments.delta`` ..., the matching ``.done``
  events, then ``response.completed`` (or ``response.incomplete``) with usage.
  A stream that breaks off ends with an ``error`` event and ``response.failed``.

Nothing is stored, so whatever needs an earlier response (``previous_response_id``,
``conversation``, ``item_reference`` inputs, ``background``, stored ``prompt``
templates) is refused with a 400 that says so. ``store`` is accepted and has no
effect: replies say ``"store": false``. Only function tools can be offered;
built-in tools (web search, file search, computer use...) and file inputs are
refused with a 400 naming the item.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.protocols.base import BROKEN, BUDGET, TranslationError, dumps

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_STATEFUL = {
    "previous_response_id": "'previous_response_id' needs responses stored by the "
    "server",
    "conversation": "'conversation' needs conversations stored by the server",
    "prompt": "'prompt' (a stored prompt template) needs prompts stored by the server",
}
_STATELESS_HINT = (
    "Nexus serves the Responses API statelessly and stores nothing; send the whole "
    "conversation in 'input' instead."
)
_MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system"}
_IMAGE_DETAILS = frozenset({"low", "high", "auto"})
_INCOMPLETE_REASONS = {
    "length": "max_output_tokens",
    "content_filter": "content_filter",
}


def responses_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """Translate a Responses request body into a canonical chat request.

    Raises TranslationError (400) for malformed fields and for anything that
    needs state or a tool the canonical form cannot carry.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise _bad("'model' is required and must be a string.", "model")
    for key, why in _STATEFUL.items():
        if body.get(key) is not None:
            raise TranslationError(
                400,
                f"{why}. {_STATELESS_HINT}",
                param=key,
                code="unsupported_parameter",
            )
    if body.get("background") is True:
        raise TranslationError(
            400,
            f"'background' responses need responses stored by the server. "
            f"{_STATELESS_HINT}",
            param="background",
            code="unsupported_parameter",
        )
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string.", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    _add_input(messages, body.get("input"))
    if not messages:
        raise _bad("'input' must not be empty.", "input")
    chat: dict[str, Any] = {"model": model, "messages": messages}
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean.", "stream")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    tools = body.get("tools")
    if tools is not None:
        converted = _convert_tools(tools)
        if converted:
            chat["tools"] = converted
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _convert_tool_choice(body["tool_choice"])
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _bad(
                "'parallel_tool_calls' must be a boolean.", "parallel_tool_calls"
            )
        if "tools" in chat:
            chat["parallel_tool_calls"] = parallel
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise _bad(
                "'max_output_tokens' must be a positive whole number.",
                "max_output_tokens",
            )
        chat["max_tokens"] = limit
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad(f"'{key}' must be a number.", key)
            chat[key] = value
    user = body.get("user")
    if isinstance(user, str) and user:
        chat["user"] = user
    response_format = _convert_text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def chat_to_response(
    reply: Mapping[str, Any],
    request: Mapping[str, Any],
    *,
    response_id: str,
    created_at: int,
) -> dict[str, Any]:
    """Translate a canonical ``chat.completion`` into a Responses ``response``.

    ``request`` is the client's Responses body (its settings are echoed back).
    """
    choices = reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") if isinstance(choice, Mapping) else None
    if not isinstance(message, Mapping):
        message = {}
    output: list[dict[str, Any]] = []
    text = message.get("content")
    refusal = message.get("refusal")
    if isinstance(text, list):
        text = "".join(
            part.get("text", "")
            for part in text
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    parts: list[dict[str, Any]] = []
    if isinstance(text, str) and text:
        parts.append(_output_text(text))
    if isinstance(refusal, str) and refusal:
        parts.append({"type": "refusal", "refusal": refusal})
    if parts:
        output.append(_message_item(f"msg_{response_id}_0", parts, "completed"))
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            if not isinstance(call, Mapping):
                continue
            function = call.get("function")
            if not isinstance(function, Mapping):
                continue
            call_id = call.get("id")
            output.append(
                _function_call_item(
                    f"fc_{response_id}_{len(output)}",
                    call_id if isinstance(call_id, str) and call_id else None,
                    str(function.get("name") or ""),
                    _arguments_text(function.get("arguments")),
                    "completed",
                )
            )
    finish = choice.get("finish_reason") if isinstance(choice, Mapping) else None
    model = reply.get("model")
    return _response(
        request,
        response_id=response_id,
        created_at=created_at,
        model=model if isinstance(model, str) and model else None,
        status="incomplete" if finish in _INCOMPLETE_REASONS else "completed",
        output=output,
        usage=usage_of_chat(reply.get("usage")),
        incomplete_reason=_INCOMPLETE_REASONS.get(finish)
        if isinstance(finish, str)
        else None,
    )


def usage_of_chat(usage: Any) -> dict[str, Any] | None:
    """Translate a canonical usage block into the Responses API's, or None."""
    if not isinstance(usage, Mapping):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    total = usage.get("total_tokens")
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    cached = (
        prompt_details.get("cached_tokens")
        if isinstance(prompt_details, Mapping)
        else None
    )
    reasoning = (
        completion_details.get("reasoning_tokens")
        if isinstance(completion_details, Mapping)
        else None
    )
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached if isinstance(cached, int) else 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": reasoning if isinstance(reasoning, int) else 0
        },
        "total_tokens": total if isinstance(total, int) else prompt + completion,
    }


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
        reason = _INCOMPLETE_REASONS.get(self._finish or "")
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
            item = _message_item(self._text_item, [], "in_progress")
            out.append(self._item_event("added", self._text_index, item))
            out.append(
                self._event(
                    "response.content_part.added",
                    {
                        "item_id": self._text_item,
                        "output_index": self._text_index,
                        "content_index": 0,
                        "part": _output_text(""),
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
            item = _function_call_item(
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
        part = _output_text(text)
        item = _message_item(self._text_item, [part], status)
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
                item = _function_call_item(
                    call.item_id, call.call_id, call.name, "", "in_progress"
                )
                out.append(self._item_event("added", call.output_index, item))
                if arguments:
                    out.append(self._arguments_delta(call, arguments))
            item = _function_call_item(
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
        return _response(
            self._request,
            response_id=self._id,
            created_at=self._created_at,
            model=self._model,
            status=status,
            output=[item for item in self._output if item],
            usage=self._usage if usage else None,
            incomplete_reason=incomplete_reason,
            error=error,
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


# Requests


def _add_input(messages: list[dict[str, Any]], value: Any) -> None:
    if isinstance(value, str):
        if value:
            messages.append({"role": "user", "content": value})
        return
    if not isinstance(value, list):
        raise _bad("'input' must be a string or an array of input items.", "input")
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise _bad(f"{where} must be an object.", where)
        kind = item.get("type")
        if kind is None or kind == "message":
            _add_message(messages, item, where)
        elif kind == "function_call":
            _add_function_call(messages, item, where)
        elif kind == "function_call_output":
            _add_function_output(messages, item, where)
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise TranslationError(
                400,
                f"{where}: 'item_reference' inputs need items stored by the server. "
                f"{_STATELESS_HINT}",
                param=where,
                code="unsupported_parameter",
            )
        else:
            raise TranslationError(
                400,
                f"{where}: input items of type {kind!r} are not supported by Nexus "
                "(messages, function_call and function_call_output are).",
                param=f"{where}.type",
                code="unsupported_parameter",
            )


def _add_message(
    messages: list[dict[str, Any]], item: Mapping[str, Any], where: str
) -> None:
    role = item.get("role")
    content = item.get("content")
    if role == "assistant":
        text = _joined_text(content, where)
        messages.append({"role": "assistant", "content": text})
        return
    canonical_role = _MESSAGE_ROLES.get(role) if isinstance(role, str) else None
    if canonical_role is None:
        raise _bad(
            f"{where}.role must be 'user', 'assistant', 'system' or 'developer'.",
            f"{where}.role",
        )
    if canonical_role == "system":
        messages.append({"role": "system", "content": _joined_text(content, where)})
        return
    if isinstance(content, str):
        messages.append({"role": "user", "content": content})
        return
    parts = _content_parts(content, where)
    if len(parts) == 1 and parts[0]["type"] == "text":
        messages.append({"role": "user", "content": parts[0]["text"]})
    else:
        messages.append({"role": "user", "content": parts})


def _content_parts(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise _bad(
            f"{where}.content must be a string or an array of content parts.",
            f"{where}.content",
        )
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if not isinstance(part, Mapping):
            raise _bad(f"{at} must be an object.", at)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"{at}.text must be a string.", f"{at}.text")
            parts.append({"type": "text", "text": text})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                if part.get("file_id") is not None:
                    raise TranslationError(
                        400,
                        f"{at}: images by 'file_id' need files stored by the server; "
                        "send 'image_url' (a URL or a data: URL) instead.",
                        param=f"{at}.file_id",
                        code="unsupported_parameter",
                    )
                raise _bad(f"{at}.image_url must be a URL or a data: URL.", at)
            image: dict[str, Any] = {"url": url}
            detail = part.get("detail")
            if detail in _IMAGE_DETAILS:
                image["detail"] = detail
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise TranslationError(
                400,
                f"{at}: content parts of type {kind!r} are not supported by Nexus "
                "(input_text and input_image are).",
                param=f"{at}.type",
                code="unsupported_parameter",
            )
    return parts


def _joined_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for index, part in enumerate(_content_parts(content, where)):
        if part["type"] != "text":
            raise _bad(
                f"{where}.content[{index}]: this message cannot carry images.",
                f"{where}.content[{index}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _add_function_call(
    messages: list[dict[str, Any]], item: Mapping[str, Any], where: str
) -> None:
    call_id, name = item.get("call_id"), item.get("name")
    arguments = item.get("arguments", "")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.call_id must be a non-empty string.", f"{where}.call_id")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.name must be a non-empty string.", f"{where}.name")
    if not isinstance(arguments, str):
        raise _bad(f"{where}.arguments must be a string.", f"{where}.arguments")
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        if last.get("content") == "":
            last["content"] = None
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _add_function_output(
    messages: list[dict[str, Any]], item: Mapping[str, Any], where: str
) -> None:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.call_id must be a non-empty string.", f"{where}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        text = _joined_text(output, f"{where}.output")
    elif isinstance(output, str):
        text = output
    else:
        raise _bad(
            f"{where}.output must be a string or an array of input_text parts.",
            f"{where}.output",
        )
    messages.append({"role": "tool", "tool_call_id": call_id, "content": text})


def _convert_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array.", "tools")
    converted: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, Mapping):
            raise _bad(f"{where} must be an object.", where)
        kind = tool.get("type")
        if kind != "function":
            raise TranslationError(
                400,
                f"{where}: tools of type {kind!r} are not supported by Nexus; only "
                "function tools can be offered to the models behind it.",
                param=f"{where}.type",
                code="unsupported_parameter",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.name must be a non-empty string.", f"{where}.name")
        function: dict[str, Any] = {"name": name}
        description = tool.get("description")
        if isinstance(description, str):
            function["description"] = description
        parameters = tool.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, Mapping):
                raise _bad(
                    f"{where}.parameters must be a JSON schema object.",
                    f"{where}.parameters",
                )
            function["parameters"] = dict(parameters)
        strict = tool.get("strict")
        if isinstance(strict, bool):
            function["strict"] = strict
        converted.append({"type": "function", "function": function})
    return converted


def _convert_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
    raise TranslationError(
        400,
        "'tool_choice' must be 'auto', 'none', 'required' or "
        '{"type": "function", "name": ...}.',
        param="tool_choice",
        code="unsupported_parameter",
    )


def _convert_text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise _bad("'text' must be an object.", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise _bad("'text.format' must be an object.", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        name, schema = fmt.get("name"), fmt.get("schema")
        if not isinstance(name, str) or not name:
            raise _bad("'text.format.name' must be a string.", "text.format.name")
        if not isinstance(schema, Mapping):
            raise _bad("'text.format.schema' must be an object.", "text.format.schema")
        spec: dict[str, Any] = {"name": name, "schema": dict(schema)}
        for key in ("description", "strict"):
            if fmt.get(key) is not None:
                spec[key] = fmt[key]
        return {"type": "json_schema", "json_schema": spec}
    raise _bad(
        "'text.format.type' must be 'text', 'json_object' or 'json_schema'.",
        "text.format.type",
    )


# Replies


def _response(
    request: Mapping[str, Any],
    *,
    response_id: str,
    created_at: int,
    model: str | None,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete_reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    tools = request.get("tools")
    text = request.get("text")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason}
        if incomplete_reason
        else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": model or request.get("model"),
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": request.get("temperature"),
        "text": text if isinstance(text, Mapping) else {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": [_echo_tool(tool) for tool in tools if isinstance(tool, Mapping)]
        if isinstance(tools, list)
        else [],
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def _echo_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A function tool as a response lists it (every field present)."""
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def _message_item(
    item_id: str, content: list[dict[str, Any]], status: str
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _function_call_item(
    item_id: str, call_id: str | None, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id or f"call_{item_id}",
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _arguments_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    if arguments is None:
        return ""
    # Some backends send the arguments as an object rather than JSON text.
    return _ENCODER.encode(arguments)


def _bad(message: str, param: str) -> TranslationError:
    return TranslationError(400, message, param=param, code="invalid_request")
