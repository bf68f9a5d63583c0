"""The mock backend's answers: the reply to each model request, before delivery.

``Answers`` turns a request into the body or stream that the configured kind of
server (OpenAI, Ollama, Anthropic, or a kind from ``nexus_mock.kinds``) would
send back, or raises ``ApiError``: the model list, completions, chats,
embeddings, tool calls, Ollama's ``/api/ps``, the API key check, and the
failures ``--error-rate`` injects. It decides nothing about time; when and how
a reply is written is ``nexus_mock.server``'s concern.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import random
import time
from dataclasses import dataclass
from typing import Any

from nexus_mock.config import MockConfig
from nexus_mock.http_parsing import Request
from nexus_mock.jobs import (
    ApiError,
    EmbeddingJob,
    Generation,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
    parse_json_object,
)
from nexus_mock.kinds import (
    answer_kind_request,
    check_anthropic_headers,
    check_bearer,
    describe_model,
    describe_ollama_tag,
)
from nexus_mock.memory import NodeMemory
from nexus_mock.messages import (
    answer_messages,
    anthropic_error,
    count_tokens,
)
from nexus_mock.ollama_api import (
    INFERENCE_PATHS as OLLAMA_INFERENCE_PATHS,
)
from nexus_mock.ollama_api import (
    NDJSON_CONTENT_TYPE,
    ollama_error,
    parse_ollama_request,
    render_ollama_reply,
    render_ollama_stream,
)
from nexus_mock.ollama_api import (
    is_stream as is_ollama_stream,
)
from nexus_mock.overflow import check_context
from nexus_mock.replies import (
    encode_json,
    render_embeddings,
    render_generation,
    render_stream,
)
from nexus_mock.stats import MockStats
from nexus_mock.tools import openai_tool_call, render_openai_tool_call

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclass(frozen=True, slots=True)
class Stream:
    """A streamed reply: blocks written one by one, then the tail."""

    blocks: list[bytes]
    tail: bytes
    content_type: str = SSE_CONTENT_TYPE


class Answers:
    """Answer model requests as the configured kind of model server would."""

    def __init__(self, stats: MockStats, started: int) -> None:
        self._stats = stats
        self._started = started
        self._ids = itertools.count(1)
        self._rng = random.Random()
        self._models_body = b""

    def configure(self, config: MockConfig, *, reseed: bool) -> None:
        """Take a new configuration; ``reseed`` restarts the failure draws."""
        if reseed:
            self._rng = random.Random(config.seed)
        self._models_body = encode_json(
            {
                "object": "list",
                "data": [
                    describe_model(config, model, self._started)
                    for model in config.models
                ],
            }
        )

    def answer(
        self, request: Request, config: MockConfig, memory: NodeMemory | None
    ) -> bytes | Stream:
        """Return the reply to ``request``; raise ApiError for an error reply."""
        if config.kind == "ollama" and request.path in OLLAMA_INFERENCE_PATHS:
            return self._answer_ollama(request, config)
        if memory is not None and request.path == "/api/ps":
            return _answer_ps(request, config, memory)
        if config.kind == "anthropic" and request.path.startswith("/v1/messages"):
            return self._answer_messages(request, config)
        if config.kind != "openai":
            kind_reply = answer_kind_request(request, config, self._started)
            if kind_reply is not None:
                return kind_reply
        if config.api_key is not None:
            _check_api_key(request, config.api_key)
        path = request.path
        if path == "/v1/models" or path.startswith("/v1/models/"):
            require_method(request, "GET")
            if path == "/v1/models":
                return self._models_body
            model_id = path[len("/v1/models/") :]
            if model_id not in config.models:
                raise ApiError(
                    404,
                    f"The model '{model_id}' does not exist or you do not have "
                    "access to it.",
                    param="model",
                    code="model_not_found",
                )
            return encode_json(describe_model(config, model_id, self._started))
        if path not in INFERENCE_PATHS:
            raise ApiError(404, f"Invalid URL ({request.method} {path})")
        require_method(request, "POST")
        payload = parse_json_object(request.body)
        job: Generation | EmbeddingJob
        if path == "/v1/embeddings":
            job = parse_embedding_request(payload, config.models, config.embedding_dim)
        elif path == "/v1/chat/completions":
            job = parse_chat_request(payload, config.name, config.models)
            self._check_context(config, payload)
        else:
            job = parse_completion_request(payload, config.name, config.models)
        self._inject_failure(config, request.body)
        if isinstance(job, EmbeddingJob):
            return render_embeddings(job)
        prefix = "chatcmpl" if job.kind == "chat" else "cmpl"
        completion_id = f"{prefix}-mock-{next(self._ids)}"
        created = int(time.time())
        call = None
        if job.kind == "chat" and "tools" in payload:
            call = openai_tool_call(payload, config.tool_arguments)
        if call is not None:
            reply = render_openai_tool_call(
                call,
                job.model,
                completion_id,
                created,
                job.prompt_tokens,
                job.stream,
                job.include_usage,
                config.chunks,
            )
            return reply if isinstance(reply, bytes) else Stream(*reply)
        if config.cached_tokens and job.kind == "chat":
            job = dataclasses.replace(
                job,
                cached_tokens=config.cached_tokens,
                cache_timings=config.kind == "llamacpp",
            )
        if job.stream:
            return Stream(*render_stream(job, completion_id, created, config.chunks))
        return render_generation(job, completion_id, created)

    def _answer_ollama(self, request: Request, config: MockConfig) -> bytes | Stream:
        check_bearer(request, config, ollama=True)
        if request.method != "POST":
            raise ollama_error(405, "method not allowed")
        job = parse_ollama_request(
            request.path,
            request.body,
            config.name,
            config.models,
            config.tool_arguments,
            config.embedding_dim,
        )
        if isinstance(job, bytes):
            return job
        if request.path == "/api/chat":
            self._check_context(config, parse_json_object(request.body))
        try:
            self._inject_failure(config, request.body)
        except ApiError as error:
            raise ollama_error(error.status, error.message) from None
        if not isinstance(job, EmbeddingJob) and is_ollama_stream(job):
            blocks, tail = render_ollama_stream(job, config.chunks)
            return Stream(blocks, tail, NDJSON_CONTENT_TYPE)
        return render_ollama_reply(job, request.path)

    def _answer_messages(self, request: Request, config: MockConfig) -> bytes | Stream:
        check_anthropic_headers(request, config)
        require_method(request, "POST")
        if request.path == "/v1/messages/count_tokens":
            return count_tokens(request.body, config.models)
        if request.path != "/v1/messages":
            raise anthropic_error(404, "Not found")
        try:
            self._inject_failure(config, request.body)
        except ApiError as error:
            raise anthropic_error(error.status, error.message) from None
        reply = answer_messages(
            request.body,
            config.name,
            config.models,
            config.chunks,
            config.tool_arguments,
            cache=(config.cached_tokens, config.cache_write_tokens),
        )
        return reply if isinstance(reply, bytes) else Stream(*reply)

    def _check_context(self, config: MockConfig, payload: dict[str, Any]) -> None:
        try:
            check_context(config, payload)
        except ApiError:
            self._stats.context_overflows += 1
            raise

    def _inject_failure(self, config: MockConfig, body: bytes) -> None:
        text = config.fail_on_text
        if text is not None and text.encode() in body:
            message = f"answers {config.fail_status} to requests holding {text!r}"
        else:
            rate = config.error_rate
            if rate <= 0 or (rate < 1 and self._rng.random() >= rate):
                return
            message = (
                f"answers {config.fail_status} to {rate:.0%} of inference requests"
            )
        self._stats.injected_failures += 1
        raise ApiError(
            config.fail_status,
            f"Injected failure: mock backend '{config.name}' {message}.",
            code="mock_injected_failure",
        )


def require_method(request: Request, *allowed: str) -> None:
    """Raise a 405 ApiError unless the request uses one of ``allowed``."""
    if request.method not in allowed:
        raise ApiError(
            405,
            f"Method {request.method} is not allowed for {request.path}; use "
            f"{' or '.join(allowed)}.",
            headers=(("Allow", ", ".join(allowed)),),
        )


def _answer_ps(request: Request, config: MockConfig, memory: NodeMemory) -> bytes:
    check_bearer(request, config, ollama=True)
    if request.method not in ("GET", "HEAD"):
        raise ollama_error(405, "method not allowed")
    return encode_json(
        {
            "models": [
                {**describe_ollama_tag(config, entry["name"]), **entry}
                for entry in memory.ps(config.context_length)
                if entry["name"] in config.models or entry["name"] in memory.resident
            ]
        }
    )


def _check_api_key(request: Request, api_key: str) -> None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401,
            "You didn't provide an API key. Send it in an Authorization header "
            "using Bearer auth (Authorization: Bearer YOUR_KEY).",
            code="invalid_api_key",
        )
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
