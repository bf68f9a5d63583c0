"""Anthropic backends: a canonical request to Messages, its answers to canonical.

``canonical_to_messages`` writes an OpenAI chat request as a ``POST
/v1/messages`` body; ``message_to_canonical`` reads a Message back as a
``chat.completion`` (``MessageStreamReader``, in ``streams``, does the same for
a stream).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.protocols.anthropic.wire import (
    STOP_TO_FINISH,
    image_source_from_url,
    usage_to_canonical,
)
from gateway.protocols.base import TranslationError
from gateway.protocols.prompt_cache import cache_control_of

# Anthropic requires max_tokens; chat requests often leave it out.
DEFAULT_MAX_TOKENS = 4096


def canonical_to_messages(request: dict[str, Any]) -> dict[str, Any]:
    """Write an OpenAI chat request as an Anthropic Messages request.

    System and developer messages become ``system``; tool messages become
    ``tool_result`` blocks of a user turn; consecutive turns of one role are
    merged (Anthropic alternates). A ``cache_control`` on a text part or a
    tool (how OpenAI clients of Anthropic models mark prompt-cache
    breakpoints) is kept on its block. Raises TranslationError (400) for what
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
            _text_block(part)
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
    if content is None:
        return []
    raise TranslationError(400, f"{where}.content: expected text.", param=where)


def _text_block(part: dict[str, Any]) -> dict[str, Any]:
    """A text part as a text block, with the part's breakpoint if it has one."""
    block: dict[str, Any] = {"type": "text", "text": part["text"]}
    control = cache_control_of(part)
    if control is not None:
        block["cache_control"] = control
    return block


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
            blocks.append(_text_block(part))
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
    control = cache_control_of(tool)
    if control is not None:
        out["cache_control"] = control
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
        "id": completion_id(message.get("id")),
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


def completion_id(message_id: Any) -> str:
    """A completion id made from a Message's id (``chatcmpl-`` and the same suffix)."""
    if isinstance(message_id, str) and message_id:
        return "chatcmpl-" + message_id.removeprefix("msg_")
    return "chatcmpl-nexus"
