"""Ollama requests -> ``OllamaRequest``s: the canonical body and native-only fields.

``parse_chat``, ``parse_generate``, ``parse_embed`` and ``parse_embeddings``
check an ``/api/chat``, ``/api/generate``, ``/api/embed`` or ``/api/embeddings``
body and write it as a canonical chat or embeddings request: messages, images,
tool calls and their answers, tools, ``format`` and ``options``. Fields only a
native backend would honour are named in ``native_only``; a malformed body
raises a TranslationError (400).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.protocols.base import TranslationError

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# options -> canonical fields with the same meaning.
_SAME_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
_IMAGE_TYPES = (
    ("iVBORw0KGgo", "image/png"),
    ("/9j/", "image/jpeg"),
    ("R0lGOD", "image/gif"),
    ("UklGR", "image/webp"),
    ("Qk", "image/bmp"),
)

Endpoint = Literal["chat", "embeddings"]


@dataclass(frozen=True, slots=True)
class OllamaRequest:
    """An Ollama request, read: the canonical body and what only Ollama can do.

    ``endpoint`` is the canonical endpoint (``chat`` or ``embeddings``);
    ``native_only`` names fields that a translation would lose (the surface
    refuses them unless the backend is Ollama itself).
    """

    endpoint: Endpoint
    model: str
    canonical: dict[str, Any]
    stream: bool
    load_only: bool = False
    native_only: tuple[str, ...] = ()


def parse_chat(body: Mapping[str, Any]) -> OllamaRequest:
    """Read an ``/api/chat`` body; raise TranslationError (400) when malformed."""
    model = _model(body)
    stream = _stream(body)
    raw_messages = body.get("messages")
    if raw_messages is None:
        raw_messages = []
    if not isinstance(raw_messages, list):
        raise _bad("messages must be an array")
    messages = _convert_messages(raw_messages)
    canonical: dict[str, Any] = {"model": model, "messages": messages}
    tools = body.get("tools")
    if tools is not None:
        converted = _convert_tools(tools)
        if converted:
            canonical["tools"] = converted
    _apply_common(canonical, body, stream)
    return OllamaRequest("chat", model, canonical, stream, load_only=not raw_messages)


def parse_generate(body: Mapping[str, Any]) -> OllamaRequest:
    """Read an ``/api/generate`` body; raise TranslationError (400) when malformed."""
    model = _model(body)
    stream = _stream(body)
    prompt = _optional_text(body, "prompt")
    system = _optional_text(body, "system")
    images = _images(body.get("images"), "images")
    native_only = tuple(
        key
        for key in ("suffix", "template", "context", "raw")
        if body.get(key) not in (None, "", [], False)
    )
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": _user_content(prompt, images)})
    canonical: dict[str, Any] = {"model": model, "messages": messages}
    _apply_common(canonical, body, stream)
    return OllamaRequest(
        "chat",
        model,
        canonical,
        stream,
        load_only=not prompt and not images,
        native_only=native_only,
    )


def parse_embed(body: Mapping[str, Any]) -> OllamaRequest:
    """Read an ``/api/embed`` body; raise TranslationError (400) when malformed."""
    model = _model(body)
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if inputs is None:
        inputs = []
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        raise _bad("input must be a string or an array of strings")
    canonical: dict[str, Any] = {"model": model, "input": inputs}
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise _bad("dimensions must be an integer")
        if dimensions > 0:
            canonical["dimensions"] = dimensions
    _check_options(body.get("options"))
    load_only = not any(inputs)
    return OllamaRequest("embeddings", model, canonical, False, load_only=load_only)


def parse_embeddings(body: Mapping[str, Any]) -> OllamaRequest:
    """Read a legacy ``/api/embeddings`` body (one ``prompt``)."""
    model = _model(body)
    prompt = _optional_text(body, "prompt")
    _check_options(body.get("options"))
    canonical = {"model": model, "input": [prompt]}
    return OllamaRequest("embeddings", model, canonical, False, load_only=not prompt)


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise _bad("model is required")
    return model


def _stream(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream")
    if stream is None:
        return True  # Ollama streams unless told not to.
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean")
    return stream


def _optional_text(body: Mapping[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _bad(f"{key} must be a string")
    return value


def _apply_common(
    canonical: dict[str, Any], body: Mapping[str, Any], stream: bool
) -> None:
    if stream:
        canonical["stream"] = True
        canonical["stream_options"] = {"include_usage": True}
    response_format = _convert_format(body.get("format"))
    if response_format is not None:
        canonical["response_format"] = response_format
    canonical.update(_check_options(body.get("options")))


def _check_options(options: Any) -> dict[str, Any]:
    """Validate ``options``; return the canonical fields they map to."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise _bad("options must be an object")
    out: dict[str, Any] = {}
    for key, target in _SAME_OPTIONS.items():
        value = options.get(key)
        if value is not None:
            out[target] = _number(value, key)
    seed = options.get("seed")
    if seed is not None:
        out["seed"] = _integer(seed, "seed")
    limit = options.get("num_predict")
    if limit is not None and _integer(limit, "num_predict") > 0:
        out["max_tokens"] = limit
    stop = options.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("options.stop must be a string or an array of strings")
        if stops:
            out["stop"] = stops
    for key in ("num_ctx", "top_k", "num_keep", "repeat_last_n", "num_thread"):
        if options.get(key) is not None:
            _integer(options[key], key)
    return out


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"options.{key} must be a number")
    return value


def _integer(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"options.{key} must be an integer")
    return value


def _convert_format(fmt: Any) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, Mapping):
        return {
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": dict(fmt)},
        }
    raise _bad('format must be "json" or a JSON schema object')


def _convert_messages(raw: list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    # Calls not answered yet, oldest first: (id, name).
    pending: list[tuple[str, str]] = []
    ids = 0
    for index, message in enumerate(raw):
        if not isinstance(message, Mapping):
            raise _bad(f"messages[{index}] must be an object")
        role = message.get("role")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{index}].content must be a string")
        images = _images(message.get("images"), f"messages[{index}].images")
        if role == "user":
            messages.append({"role": "user", "content": _user_content(content, images)})
            continue
        if images:
            raise _bad(f"messages[{index}]: only user messages can carry images")
        if role == "system":
            messages.append({"role": "system", "content": content})
        elif role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": content}
            calls = message.get("tool_calls")
            if calls:
                if not isinstance(calls, list):
                    raise _bad(f"messages[{index}].tool_calls must be an array")
                converted = []
                for position, call in enumerate(calls):
                    ids += 1
                    call_id, name, arguments = _read_native_call(
                        call, f"messages[{index}].tool_calls[{position}]", ids
                    )
                    pending.append((call_id, name))
                    converted.append(
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": arguments},
                        }
                    )
                out["tool_calls"] = converted
                if not content:
                    out["content"] = None
            messages.append(out)
        elif role == "tool":
            answered = _answer_call(message, pending)
            if answered is None:
                ids += 1
                answered = f"call_{ids}"
            messages.append(
                {"role": "tool", "tool_call_id": answered, "content": content}
            )
        else:
            raise _bad(
                f"messages[{index}].role must be system, user, assistant or tool"
            )
    return messages


def _read_native_call(call: Any, where: str, number: int) -> tuple[str, str, str]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise _bad(f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.function.name must be a string")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        text = arguments
    elif isinstance(arguments, Mapping):
        text = _ENCODER.encode(arguments)
    else:
        raise _bad(f"{where}.function.arguments must be an object")
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        call_id = f"call_{number}"
    return call_id, name, text


def _answer_call(
    message: Mapping[str, Any], pending: list[tuple[str, str]]
) -> str | None:
    """Which earlier call a tool message answers: by id, else by name, else oldest."""
    wanted_id = message.get("tool_call_id")
    wanted_name = message.get("tool_name") or message.get("name")
    for position, (call_id, _name) in enumerate(pending):
        if call_id == wanted_id:
            return pending.pop(position)[0]
    for position, (_call_id, name) in enumerate(pending):
        if name == wanted_name:
            return pending.pop(position)[0]
    if isinstance(wanted_id, str) and wanted_id:
        return wanted_id
    return pending.pop(0)[0] if pending else None


def _images(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(image, str) and image for image in value
    ):
        raise _bad(f"{where} must be an array of base64-encoded images")
    return value


def _user_content(text: str, images: list[str]) -> Any:
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for image in images:
        url = image if image.startswith("data:") else _data_url(image)
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _data_url(base64_image: str) -> str:
    media_type = next(
        (kind for magic, kind in _IMAGE_TYPES if base64_image.startswith(magic)),
        "image/png",
    )
    return f"data:{media_type};base64,{base64_image}"


def _convert_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("tools must be an array")
    converted = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping):
            raise _bad(f"tools[{index}].function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{index}].function.name must be a string")
        spec: dict[str, Any] = {"name": name}
        if isinstance(function.get("description"), str):
            spec["description"] = function["description"]
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, Mapping):
                raise _bad(f"tools[{index}].function.parameters must be an object")
            spec["parameters"] = dict(parameters)
        converted.append({"type": "function", "function": spec})
    return converted


def _bad(message: str) -> TranslationError:
    return TranslationError(400, message, code="invalid_request")
