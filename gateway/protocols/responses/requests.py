"""Responses requests -> canonical chat completions requests.

``responses_to_chat`` checks a ``POST /v1/responses`` body and writes it as a
chat completions request: ``instructions`` and ``input`` items become
``messages``; function tools, ``tool_choice``, sampling fields and
``text.format`` are mapped. Whatever needs state stored by the server, and
tools or inputs chat completions cannot carry, raise a TranslationError (400)
that says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.protocols.base import TranslationError

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


def _bad(message: str, param: str) -> TranslationError:
    return TranslationError(400, message, param=param, code="invalid_request")
