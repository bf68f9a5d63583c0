"""Validate OpenAI request bodies into jobs for the mock backend to answer.

A job already holds the reply text and token counts; both rules are documented in
``nexus_mock.replies``, next to the wire format.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from nexus_mock.ensemble import ensemble_reply
from nexus_mock.structured import FormatError, read_response_format, render_structured

MAX_CHOICES = 128
MAX_EMBEDDING_DIM = 8192

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error answered in OpenAI's error shape with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
        body: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        # Another server's error shape (Ollama, llama.cpp, Anthropic), verbatim.
        self.body = body
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _ERROR_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def render(self) -> bytes:
        """Return the JSON error body."""
        if self.body is not None:
            return self.body
        error = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.code,
        }
        return json.dumps({"error": error}, ensure_ascii=False).encode()


@dataclass(frozen=True, slots=True)
class Generation:
    """What the mock answers to one chat or completions request."""

    kind: Literal["chat", "text"]
    model: str
    texts: tuple[str, ...]
    finish_reasons: tuple[str, ...]
    prompt_tokens: int
    stream: bool
    include_usage: bool
    # Prompt tokens reported as read from a prompt cache: in the usage block
    # (OpenAI, vLLM), or as llama.cpp's timings.cache_n (``cache_timings``).
    cached_tokens: int = 0
    cache_timings: bool = False

    def usage(self) -> dict[str, Any]:
        completion = sum(len(text.split()) for text in self.texts)
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        if self.cached_tokens and not self.cache_timings:
            cached = min(self.cached_tokens, self.prompt_tokens)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def beside_usage(self) -> dict[str, Any]:
        """Fields that go next to the usage block (llama.cpp's timings)."""
        if not (self.cached_tokens and self.cache_timings):
            return {}
        cached = min(self.cached_tokens, self.prompt_tokens)
        completion = sum(len(text.split()) for text in self.texts)
        timings = {
            "cache_n": cached,
            "prompt_n": self.prompt_tokens - cached,
            "prompt_ms": 1.0,
            "predicted_n": completion,
            "predicted_ms": 1.0,
        }
        return {"timings": timings}


@dataclass(frozen=True, slots=True)
class EmbeddingJob:
    """A validated embeddings request."""

    model: str
    inputs: tuple[str, ...]
    dimensions: int
    encoding: Literal["float", "base64"]


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise ApiError(
            400,
            "We could not parse the JSON body of your request. The body must be "
            "valid JSON (with Content-Type: application/json).",
        ) from None
    if not isinstance(payload, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return payload


def parse_chat_request(
    payload: dict[str, Any], backend: str, models: Collection[str]
) -> Generation:
    """Validate a chat completions request and decide the reply."""
    model = _require_model(payload, models)
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(
            400,
            "'messages' is required and must be a non-empty array of messages.",
            param="messages",
        )
    prompt_words = 0
    last_user_text = ""
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(
                400,
                f"messages[{index}] must be an object with a string 'role'.",
                param=f"messages[{index}]",
            )
        text = _message_text(message.get("content"), index)
        prompt_words += len(text.split())
        if message["role"] == "user":
            last_user_text = text
        elif message["role"] == "tool":
            last_user_text = f"tool result: {text}"
    reply = ensemble_reply(backend, model, last_user_text)
    if reply is None:
        reply = f"[{backend}/{model}] echo: {last_user_text}"
        reply = _apply_format(payload, reply, last_user_text)
    return _build_generation("chat", payload, model, [reply], prompt_words)


def parse_completion_request(
    payload: dict[str, Any], backend: str, models: Collection[str]
) -> Generation:
    """Validate a (legacy) completions request and decide the reply."""
    model = _require_model(payload, models)
    prompt = payload.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if (
        not isinstance(prompts, list)
        or not prompts
        or not all(isinstance(item, str) for item in prompts)
    ):
        raise ApiError(
            400,
            "'prompt' is required and must be a string or a non-empty array of "
            "strings (token arrays are not supported by the mock).",
            param="prompt",
        )
    replies = [
        _apply_format(payload, f"[{backend}/{model}] echo: {text}", text)
        for text in prompts
    ]
    prompt_words = sum(len(text.split()) for text in prompts)
    return _build_generation("text", payload, model, replies, prompt_words)


def parse_embedding_request(
    payload: dict[str, Any], models: Collection[str], default_dim: int
) -> EmbeddingJob:
    """Validate an embeddings request."""
    model = _require_model(payload, models)
    raw = payload.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if (
        not isinstance(inputs, list)
        or not inputs
        or not all(isinstance(item, str) and item for item in inputs)
    ):
        raise ApiError(
            400,
            "'input' is required and must be a non-empty string or a non-empty "
            "array of non-empty strings.",
            param="input",
        )
    encoding: Literal["float", "base64"]
    match payload.get("encoding_format"):
        case "float" | None:
            encoding = "float"
        case "base64":
            encoding = "base64"
        case other:
            raise ApiError(
                400,
                f"'encoding_format' must be 'float' or 'base64', not {other!r}.",
                param="encoding_format",
            )
    dimensions = payload.get("dimensions")
    if dimensions is None:
        dimensions = default_dim
    elif (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, int)
        or not 1 <= dimensions <= MAX_EMBEDDING_DIM
    ):
        raise ApiError(
            400,
            f"'dimensions' must be a whole number from 1 to {MAX_EMBEDDING_DIM}.",
            param="dimensions",
        )
    return EmbeddingJob(model, tuple(inputs), dimensions, encoding)


def _apply_format(payload: dict[str, Any], echo: str, user_text: str) -> str:
    """The reply: the echo, or JSON when ``response_format`` asks for it."""
    try:
        fmt = read_response_format(payload.get("response_format"))
    except FormatError as error:
        raise ApiError(400, str(error), param=error.param) from None
    return echo if fmt is None else render_structured(fmt, echo, user_text)


def _require_model(payload: dict[str, Any], models: Collection[str]) -> str:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a string.", param="model")
    if model not in models:
        raise ApiError(
            404,
            f"The model '{model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return model


def _message_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ApiError(
                    400,
                    f"messages[{index}].content parts must be objects with a 'type'.",
                    param=f"messages[{index}].content",
                )
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ApiError(
                        400,
                        f"messages[{index}].content text parts need a string 'text'.",
                        param=f"messages[{index}].content",
                    )
                texts.append(text)
        return " ".join(texts)
    raise ApiError(
        400,
        f"messages[{index}].content must be a string, an array of parts or null.",
        param=f"messages[{index}].content",
    )


def _build_generation(
    kind: Literal["chat", "text"],
    payload: dict[str, Any],
    model: str,
    replies: list[str],
    prompt_words: int,
) -> Generation:
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean.", param="stream")
    include_usage = _parse_stream_options(payload.get("stream_options"), stream)
    n = payload.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(
            400, f"'n' must be a whole number from 1 to {MAX_CHOICES}.", param="n"
        )
    limit_key = "max_completion_tokens" if "max_completion_tokens" in payload else None
    limit_key = limit_key or "max_tokens"
    limit = payload.get(limit_key)
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
    ):
        raise ApiError(
            400, f"'{limit_key}' must be a positive whole number.", param=limit_key
        )
    texts: list[str] = []
    reasons: list[str] = []
    for reply in replies:
        words = reply.split()
        if limit is not None and len(words) > limit:
            texts += [" ".join(words[:limit])] * n
            reasons += ["length"] * n
        else:
            texts += [reply] * n
            reasons += ["stop"] * n
    return Generation(
        kind=kind,
        model=model,
        texts=tuple(texts),
        finish_reasons=tuple(reasons),
        prompt_tokens=max(1, prompt_words),
        stream=stream,
        include_usage=include_usage,
    )


def _parse_stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise ApiError(
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    if not isinstance(options, dict):
        raise ApiError(
            400, "'stream_options' must be an object.", param="stream_options"
        )
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(
            400,
            "'stream_options.include_usage' must be a boolean.",
            param="stream_options.include_usage",
        )
    return include_usage
