"""Anthropic backends: a canonical request to Messages, its answers to canonical.

``canonical_to_messages`` writes an OpenAI chat request as a ``POST
/v1/messages`` body; ``message_to_canonical`` reads a Message back as a
``chat.completion``; ``MessageStreamReader`` reads Anthropic's stream events
into ``chat.completion.chunk`` dicts as they come.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.protocols.anthropic.wire import (
    STOP_TO_FINISH,
    image_source_from_url,
    usage_to_canonical,
)
from gateway.protocols.base import StreamFailed, TranslationError

# Anthropic requires max_tokens; chat requests often leave it out.
DEFAULT_MAX_TOKENS = 4096


def canonical_to_messages(request: dict[str, Any]) -> dict[str, Any]:
    """Write an OpenAI chat request as an Anthropic Messages request.

    System and developer messages become ``system``; tool messages become
    ``tool_result`` blocks of a user turn; consecutive turns of one role are
    merged (Anthropic alternates). Raises TranslationError (400) for what
    Anthropic cannot take: more than one choice, audio or file parts, JSON
    response formats, tool arguments that are not a JSON object.
    """
    if request.get("n") not in (None, 1):
        raise TranslationError(
            400, "n: Anthropic backends return one choice per request.", param="n"
        )
    response_format = request.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") != "text":
        raise TranslationError(
            400,
            "response_format: Anthropic backends have no JSON mode.",
            param="response_format",
        )
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(request.get("messages") or ()):
        where = f"messages[{index}]"
        role = message.get("role")
        if role in ("system", "developer"):
            system += _text_blocks(message.get("content"), where)
        elif role == "user":
            _add_turn(turns, "user", _user_content(message.get("content"), where))
        elif role == "assistant":
            _add_turn(turns, "assistant", _assistant_content(message, where))
        elif role == "tool":
            _add_turn(turns, "user", [_tool_result(message, where)])
        else:
            raise TranslationError(
                400, f"{where}.role: '{role}' is not a chat role.", param=where
            )
    limit = request.get("max_completion_tokens") or request.get("max_tokens")
    body: dict[str, Any] = {
        "model": request.get("model"),
        "max_tokens": limit if isinstance(limit, int) else DEFAULT_MAX_TOKENS,
        "messages": turns,
    }
    if system:
        only_text = len(system) == 1 and set(system[0]) == {"type", "text"}
        body["system"] = system[0]["text"] if only_text else system
    temperature = request.get("temperature")
    if isinstance(temperature, int | float):
        body["temperature"] = min(float(temperature), 1.0)  # OpenAI's go up to 2
    if isinstance(request.get("top_p"), int | float):
        body["top_p"] = request["top_p"]
    stop = request.get("stop")
    if isinstance(stop, str):
        body["stop_sequences"] = [stop]
    elif isinstance(stop, list) and stop:
        body["stop_sequences"] = stop
    if request.get("stream") is True:
        body["stream"] = True
    tools = request.get("tools")
    if isinstance(tools, list) and tools:
        body["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    choice = _tool_choice(
        request.get("tool_choice"), request.get("parallel_tool_calls")
    )
    if choice is not None:
        body["tool_choice"] = choice
    if isinstance(request.get("user"), str):
        body["metadata"] = {"user_id": request["user"]}
    return body


def _add_turn(turns: list[dict[str, Any]], role: str, content: Any) -> None:
    if turns and turns[-1]["role"] == role:
        last = turns[-1]
        last["content"] = _as_blocks(last["content"]) + _as_blocks(content)
    else:
        turns.append({"role": role, "content": content})


def _as_blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content)


def _text_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if isinstance(content, list):
        return [
            {"type": "text", "text": part["text"]}
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
    if content is None:
        return []
    raise TranslationError(400, f"{where}.content: expected text.", param=where)


def _user_content(content: Any, where: str) -> Any:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise TranslationError(400, f"{where}.content: expected text or parts.")
    blocks: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            blocks.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise TranslationError(
                    400, f"{at}.image_url.url: a string is required."
                )
            blocks.append({"type": "image", "source": image_source_from_url(url, at)})
        else:
            raise TranslationError(
                400,
                f"{at}: '{kind}' parts cannot be sent to Anthropic backends "
                "(text and images can).",
                param=at,
            )
    return blocks


def _assistant_content(message: dict[str, Any], where: str) -> Any:
    text = _text_blocks(message.get("content"), where)
    calls = message.get("tool_calls")
    if not calls:
        content = message.get("content")
        return content if isinstance(content, str) else text
    blocks = list(text)
    for index, call in enumerate(calls):
        at = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TranslationError(400, f"{at}.function: a name is required.", param=at)
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments)
        except (TypeError, ValueError):
            arguments = None
        if not isinstance(arguments, dict):
            raise TranslationError(
                400,
                f"{at}.function.arguments: Anthropic needs a JSON object.",
                param=at,
            )
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{index}",
                "name": function["name"],
                "input": arguments,
            }
        )
    return blocks


def _tool_result(message: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise TranslationError(400, f"{where}.tool_call_id: a string is required.")
    content = message.get("content")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id}
    if isinstance(content, list):
        block["content"] = _text_blocks(content, where)
    else:
        block["content"] = content if isinstance(content, str) else ""
    return block


def _tool(tool: Any, where: str) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(function, dict)
        or tool.get("type", "function") != "function"
        or not isinstance(function.get("name"), str)
    ):
        raise TranslationError(
            400, f"{where}: only function tools with a name are supported.", param=where
        )
    schema = function.get("parameters")
    out: dict[str, Any] = {
        "name": function["name"],
        "input_schema": schema
        if isinstance(schema, dict)
        else {"type": "object", "properties": {}},
    }
    if isinstance(function.get("description"), str):
        out["description"] = function["description"]
    return out


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    out: dict[str, Any] | None
    if choice == "auto":
        out = {"type": "auto"}
    elif choice == "required":
        out = {"type": "any"}
    elif choice == "none":
        out = {"type": "none"}
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        out = {"type": "tool", "name": choice["function"].get("name")}
    else:
        out = None
    if parallel is False:
        out = out or {"type": "auto"}
        out["disable_parallel_tool_use"] = True
    return out


# Answers


def message_to_canonical(message: dict[str, Any], created: int = 0) -> dict[str, Any]:
    """Read an Anthropic Message as a ``chat.completion``.

    Raises ValueError when it is not a Message (a backend fault).
    """
    content = message.get("content")
    if message.get("type") != "message" or not isinstance(content, list):
        raise ValueError("not an Anthropic Message")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif block.get("type") == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": json.dumps(
                            block.get("input") or {}, ensure_ascii=False
                        ),
                    },
                }
            )
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        reply["tool_calls"] = calls
    elif reply["content"] is None:
        reply["content"] = ""
    result: dict[str, Any] = {
        "id": _completion_id(message.get("id")),
        "object": "chat.completion",
        "created": created,
        "model": message.get("model"),
        "choices": [
            {
                "index": 0,
                "message": reply,
                "finish_reason": STOP_TO_FINISH.get(
                    message.get("stop_reason") or "end_turn", "stop"
                ),
            }
        ],
    }
    usage = usage_to_canonical(message.get("usage"))
    if usage is not None:
        result["usage"] = usage
    return result


def _completion_id(message_id: Any) -> str:
    if isinstance(message_id, str) and message_id:
        return "chatcmpl-" + message_id.removeprefix("msg_")
    return "chatcmpl-nexus"


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
            self._id = _completion_id(message.get("id"))
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
