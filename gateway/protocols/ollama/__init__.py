"""Ollama's native API <-> the canonical form (OpenAI chat completions, embeddings).

Requests (``parse_chat``, ``parse_generate``, ``parse_embed``,
``parse_embeddings``) become an ``OllamaRequest``: the canonical body for an
OpenAI-style backend, and what a native backend would honour that the canonical
form cannot carry (``native_only``), so that the surface can pass the body
through to an Ollama backend untouched and refuse those fields clearly anywhere
else.

- ``/api/chat``: ``messages`` (``images`` as base64 become ``image_url`` data
  URLs; assistant ``tool_calls`` with object arguments become JSON-text
  arguments with ids; ``tool`` messages are matched to their call by
  ``tool_call_id``, else ``tool_name``), ``tools``;
- ``/api/generate``: ``system`` and ``prompt`` (+ ``images``) become a chat;
  ``suffix``, ``raw``, ``template`` and ``context`` are native only;
- both: ``stream`` (Ollama's default is true), ``format`` (``"json"`` ->
  ``json_object``, a schema -> ``json_schema``), ``options``: ``temperature``,
  ``top_p``, ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``
  and ``num_predict`` (-> ``max_tokens``; negative means no limit). The other
  options (``num_ctx``, ``top_k``, ``repeat_penalty``, ...), ``keep_alive``
  and ``think`` have no canonical equivalent and are dropped when translating;
- ``/api/embed`` (``input``, ``dimensions``) and the legacy ``/api/embeddings``
  (``prompt``) become an embeddings request.

A chat with no messages, a generate with an empty prompt, and an embed of
nothing are "load the model" requests in Ollama: ``load_only`` is set and
``load_reply`` answers them.

Replies: ``chat_reply``, ``generate_reply``, ``embed_reply``,
``embeddings_reply`` turn canonical replies into Ollama's (``done``,
``done_reason``, ``prompt_eval_count``, ``eval_count``, durations in
nanoseconds); ``OllamaStreamTranslator`` turns canonical chunks into NDJSON lines
as they come (tool calls go out whole, once their arguments are complete,
because Ollama's arguments are an object). Errors are ``{"error": "..."}``
(``error_body``), also as the last line of a stream that broke off.

For pass-through, ``usage_of_native`` reads the usage of a native reply and
``NativeStreamUsage`` of a native NDJSON stream as it is relayed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.protocols.base import BROKEN, TranslationError, dumps

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# options -> canonical fields with the same meaning.
_SAME_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
_DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}
_IMAGE_TYPES = (
    ("iVBORw0KGgo", "image/png"),
    ("/9j/", "image/jpeg"),
    ("R0lGOD", "image/gif"),
    ("UklGR", "image/webp"),
    ("Qk", "image/bmp"),
)
# A stream line longer than this is not a usage line worth keeping for.
MAX_NATIVE_LINE = 1024 * 1024

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


# Replies


def chat_reply(
    reply: Mapping[str, Any], model: str, *, created_at: str, total_ns: int
) -> dict[str, Any]:
    """Translate a canonical ``chat.completion`` into an ``/api/chat`` reply."""
    message, finish = _first_choice(reply)
    out_message: dict[str, Any] = {
        "role": "assistant",
        "content": _text_of(message.get("content")),
    }
    thinking = message.get("reasoning_content")
    if isinstance(thinking, str) and thinking:
        out_message["thinking"] = thinking
    calls = _native_tool_calls(message.get("tool_calls"))
    if calls:
        out_message["tool_calls"] = calls
    return {
        "model": model,
        "created_at": created_at,
        "message": out_message,
        **_done(finish, reply.get("usage"), total_ns),
    }


def generate_reply(
    reply: Mapping[str, Any], model: str, *, created_at: str, total_ns: int
) -> dict[str, Any]:
    """Translate a canonical ``chat.completion`` into an ``/api/generate`` reply."""
    message, finish = _first_choice(reply)
    out: dict[str, Any] = {
        "model": model,
        "created_at": created_at,
        "response": _text_of(message.get("content")),
    }
    thinking = message.get("reasoning_content")
    if isinstance(thinking, str) and thinking:
        out["thinking"] = thinking
    out.update(_done(finish, reply.get("usage"), total_ns))
    return out


def embed_reply(
    reply: Mapping[str, Any], model: str, *, total_ns: int
) -> dict[str, Any]:
    """Translate a canonical embeddings reply into an ``/api/embed`` reply."""
    out: dict[str, Any] = {
        "model": model,
        "embeddings": _vectors(reply),
        "total_duration": total_ns,
        "load_duration": 0,
    }
    usage = reply.get("usage")
    if isinstance(usage, Mapping) and isinstance(usage.get("prompt_tokens"), int):
        out["prompt_eval_count"] = usage["prompt_tokens"]
    return out


def embeddings_reply(reply: Mapping[str, Any]) -> dict[str, Any]:
    """Translate a canonical embeddings reply into a legacy ``/api/embeddings`` one."""
    vectors = _vectors(reply)
    return {"embedding": vectors[0] if vectors else []}


def load_reply(path: str, model: str, *, created_at: str) -> dict[str, Any]:
    """Ollama's answer to a request that only loads the model (nothing to do)."""
    if path == "/api/chat":
        return {
            "model": model,
            "created_at": created_at,
            "message": {"role": "assistant", "content": ""},
            "done_reason": "load",
            "done": True,
        }
    if path == "/api/generate":
        return {
            "model": model,
            "created_at": created_at,
            "response": "",
            "done": True,
            "done_reason": "load",
        }
    if path == "/api/embeddings":
        return {"embedding": []}
    return {"model": model, "embeddings": []}


def error_body(message: str) -> bytes:
    """Ollama's error shape, ``{"error": "..."}``."""
    return dumps({"error": message})


def timestamp(epoch: float) -> str:
    """Format a time as Ollama's ``created_at`` (RFC 3339, UTC)."""
    whole = int(epoch)
    micros = int((epoch - whole) * 1_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{micros:06d}Z"


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
        head.update(_done(self._finish, self._usage, now - self._started))
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
            _native_call(index, pending.name, "".join(pending.arguments))
            for index, pending in sorted(self._calls.items())
        ]
        self._calls.clear()
        if self._first_token is None:
            self._first_token = self._ticks()
        line = self._head()
        line["message"] = {"role": "assistant", "content": "", "tool_calls": calls}
        line["done"] = False
        return [_line(line)]


# Pass-through usage


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


# Requests, details


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


# Replies, details


def _first_choice(reply: Mapping[str, Any]) -> tuple[Mapping[str, Any], Any]:
    choices = reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    if not isinstance(choice, Mapping):
        choice = {}
    message = choice.get("message")
    return (message if isinstance(message, Mapping) else {}), choice.get(
        "finish_reason"
    )


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return ""


def _done(finish: Any, usage: Any, total_ns: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "done": True,
        "done_reason": _DONE_REASONS.get(finish, "stop")
        if isinstance(finish, str)
        else "stop",
        "total_duration": total_ns,
        "load_duration": 0,
    }
    if isinstance(usage, Mapping):
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            out["prompt_eval_count"] = prompt
        out["prompt_eval_duration"] = 0
        if isinstance(completion, int):
            out["eval_count"] = completion
        out["eval_duration"] = total_ns
    return out


def _native_tool_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        return []
    out = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            continue
        arguments = function.get("arguments")
        text = (
            _ENCODER.encode(arguments)
            if isinstance(arguments, Mapping)
            else arguments
            if isinstance(arguments, str)
            else ""
        )
        out.append(_native_call(index, str(function.get("name") or ""), text))
    return out


def _native_call(index: int, name: str, arguments: str) -> dict[str, Any]:
    """An Ollama tool call: the arguments as an object, not JSON text."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        # Ollama's arguments are an object; keep text a model got wrong visible.
        parsed = {"_arguments": arguments}
    return {"function": {"index": index, "name": name, "arguments": parsed}}


def _vectors(reply: Mapping[str, Any]) -> list[Any]:
    data = reply.get("data")
    if not isinstance(data, list):
        return []
    items = sorted(
        (item for item in data if isinstance(item, Mapping)),
        key=lambda item: (
            item.get("index", 0) if isinstance(item.get("index"), int) else 0
        ),
    )
    return [item.get("embedding") for item in items]


def _line(value: dict[str, Any]) -> bytes:
    return dumps(value) + b"\n"


def _bad(message: str) -> TranslationError:
    return TranslationError(400, message, code="invalid_request")
