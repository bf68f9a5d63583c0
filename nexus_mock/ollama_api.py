"""Ollama's native inference API, as the mock's ``ollama`` kind answers it.

``POST /api/chat`` and ``POST /api/generate`` (NDJSON streams unless
``"stream": false``, as Ollama does), ``POST /api/embed`` and the legacy
``POST /api/embeddings``. Replies follow the OpenAI side's rules
(``nexus_mock.replies`` and ``.tools``): the same text, the same
scripted tool call (whole, in one line, with object arguments, as Ollama sends
it), the same token counts, reported as ``prompt_eval_count`` and
``eval_count``.
``options.num_predict`` limits the reply as ``max_tokens`` does; ``format``
(``"json"`` or a JSON schema) makes it JSON, as ``response_format`` does
(``nexus_mock.structured``). Durations are
made up but consistent: a millisecond per prompt token, two per reply token.
A stream has ``chunks`` content lines (``"done": false``) and a last line with
``"done": true``, ``done_reason`` and the counts. An empty ``messages`` or
``prompt`` only "loads" the model (``done_reason`` ``"load"``). Errors are
``{"error": "..."}``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Collection
from typing import Any

from nexus_mock.jobs import (
    ApiError,
    EmbeddingJob,
    Generation,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
    parse_json_object,
)
from nexus_mock.replies import encode_json, render_embeddings, split_text
from nexus_mock.structured import FormatError, read_ollama_format
from nexus_mock.tools import ToolCall, openai_tool_call

# A chat answered with a tool call: the call, and the words it counts.
_ToolChat = tuple[Generation, ToolCall]

NDJSON_CONTENT_TYPE = "application/x-ndjson"
INFERENCE_PATHS = frozenset(
    {"/api/chat", "/api/generate", "/api/embed", "/api/embeddings"}
)
_MS = 1_000_000  # nanoseconds


def ollama_error(status: int, message: str) -> ApiError:
    """An error in Ollama's shape."""
    return ApiError(status, message, body=encode_json({"error": message}))


def parse_ollama_request(
    path: str,
    body: bytes,
    backend: str,
    models: Collection[str],
    tool_arguments: dict[str, Any] | None,
    embedding_dim: int,
) -> Generation | _ToolChat | EmbeddingJob | bytes:
    """Validate a native request; return the job, or the whole reply of a load.

    Raises ApiError in Ollama's shape.
    """
    try:
        payload = parse_json_object(body)
    except ApiError:
        raise ollama_error(400, "invalid character in request body") from None
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ollama_error(400, "model is required")
    if model not in models:
        raise ollama_error(404, f'model "{model}" not found, try pulling it first')
    stream = payload.get("stream", True)
    if not isinstance(stream, bool):
        raise ollama_error(400, "stream must be a boolean")
    options = payload.get("options") or {}
    if not isinstance(options, dict):
        raise ollama_error(400, "options must be an object")
    limit = options.get("num_predict")
    openai_like: dict[str, Any] = {"model": model, "stream": stream}
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        openai_like["max_tokens"] = limit
    try:
        fmt = read_ollama_format(payload.get("format"))
    except FormatError as error:
        raise ollama_error(400, str(error)) from None
    if fmt is not None and fmt.schema is None:
        openai_like["response_format"] = {"type": "json_object"}
    elif fmt is not None:
        schema = {"schema": fmt.schema}
        openai_like["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        if path == "/api/chat":
            messages = payload.get("messages") or []
            if not messages:
                return encode_json(_load_reply(model, chat=True))
            openai_like.update(messages=messages, tools=payload.get("tools"))
            job = parse_chat_request(openai_like, backend, models)
            call = openai_tool_call(openai_like, tool_arguments)
            return job if call is None else (job, call)
        if path == "/api/generate":
            prompt = payload.get("prompt") or ""
            if not prompt:
                return encode_json(_load_reply(model, chat=False))
            return parse_completion_request(
                {**openai_like, "prompt": prompt}, backend, models
            )
        inputs = payload.get("input") if path == "/api/embed" else payload.get("prompt")
        if not inputs:
            empty = {"model": model, "embeddings": []}
            return encode_json(empty if path == "/api/embed" else {"embedding": []})
        embed: dict[str, Any] = {"model": model, "input": inputs}
        dimensions = payload.get("dimensions")
        embed["dimensions"] = dimensions if dimensions else embedding_dim
        return parse_embedding_request(embed, models, embedding_dim)
    except ApiError as error:
        raise ollama_error(error.status, error.message) from None


def render_ollama_reply(job: Generation | _ToolChat | EmbeddingJob, path: str) -> bytes:
    """The whole (not streamed) reply to a native request."""
    if isinstance(job, EmbeddingJob):
        vectors = json.loads(render_embeddings(job))
        embeddings = [item["embedding"] for item in vectors["data"]]
        if path == "/api/embeddings":
            return encode_json({"embedding": embeddings[0]})
        tokens = vectors["usage"]["prompt_tokens"]
        return encode_json(
            {
                "model": job.model,
                "embeddings": embeddings,
                "total_duration": tokens * _MS + _MS,
                "load_duration": _MS,
                "prompt_eval_count": tokens,
            }
        )
    job, call = job if isinstance(job, tuple) else (job, None)
    line = _head(job.model)
    if job.kind == "chat":
        line["message"] = _message(job.texts[0], call)
    else:
        line["response"] = job.texts[0]
    line.update(_done(job, call))
    return encode_json(line)


def render_ollama_stream(
    job: Generation | _ToolChat, chunks: int
) -> tuple[list[bytes], bytes]:
    """A streamed reply: one NDJSON line per chunk, and the last line."""
    job, call = job if isinstance(job, tuple) else (job, None)
    blocks: list[bytes] = []
    if call is not None:
        line = _head(job.model)
        line["message"] = _message("", call)
        line["done"] = False
        blocks.append(encode_json(line) + b"\n")
    else:
        for piece in split_text(job.texts[0], chunks):
            line = _head(job.model)
            if job.kind == "chat":
                line["message"] = {"role": "assistant", "content": piece}
            else:
                line["response"] = piece
            line["done"] = False
            blocks.append(encode_json(line) + b"\n")
    last = _head(job.model)
    if job.kind == "chat":
        last["message"] = {"role": "assistant", "content": ""}
    else:
        last["response"] = ""
    last.update(_done(job, call))
    return blocks, encode_json(last) + b"\n"


def is_stream(job: Generation | _ToolChat | EmbeddingJob) -> bool:
    """Whether the client asked for a stream."""
    if isinstance(job, tuple):
        return job[0].stream
    return isinstance(job, Generation) and job.stream


def _message(text: str, call: ToolCall | None) -> dict[str, Any]:
    if call is None:
        return {"role": "assistant", "content": text}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_mock_0",
                "function": {
                    "index": 0,
                    "name": call.name,
                    "arguments": call.arguments,
                },
            }
        ],
    }


def _done(job: Generation, call: ToolCall | None) -> dict[str, Any]:
    usage = job.usage()
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    if call is not None:
        job = dataclasses.replace(job, finish_reasons=("stop",))
        completion = call.tokens
    reason = job.finish_reasons[0]
    return {
        "done": True,
        "done_reason": "length" if reason == "length" else "stop",
        "total_duration": _MS + prompt * _MS + completion * 2 * _MS,
        "load_duration": _MS,
        "prompt_eval_count": prompt,
        "prompt_eval_duration": prompt * _MS,
        "eval_count": completion,
        "eval_duration": completion * 2 * _MS,
    }


def _load_reply(model: str, *, chat: bool) -> dict[str, Any]:
    line = _head(model)
    if chat:
        line["message"] = {"role": "assistant", "content": ""}
    else:
        line["response"] = ""
    line.update(done=True, done_reason="load")
    return line


def _head(model: str) -> dict[str, Any]:
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
    return {"model": model, "created_at": f"{stamp}.{int(now % 1 * 1e6):06d}Z"}
