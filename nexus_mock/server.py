"""The mock backend's server: routes, failure injection, stats and the control API."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from nexus_mock.config import ConfigError, MockConfig
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
from nexus_mock.listener import Listener
from nexus_mock.memory import NodeMemory, parse_keep_alive
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
from nexus_mock.protocol import Header, HttpConnection
from nexus_mock.replies import (
    encode_json,
    render_embeddings,
    render_generation,
    render_stream,
)
from nexus_mock.stats import MockStats, RecordedRequest
from nexus_mock.tools import openai_tool_call, render_openai_tool_call

logger = logging.getLogger(__name__)

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
CONTROL_PREFIX = "/_mock/"
# The longest a request is held by POST /_mock/hold.
HOLD_SECONDS = 30.0
_INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# Also held to --slots (what a model server runs).
_SLOTTED_PATHS = (*_INFERENCE_PATHS, "/v1/messages")


@dataclass(frozen=True, slots=True)
class _Stream:
    blocks: list[bytes]
    tail: bytes
    content_type: str = SSE_CONTENT_TYPE


class MockBackend:
    """An OpenAI-compatible model server that echoes, on purpose, what it is asked."""

    def __init__(self, config: MockConfig) -> None:
        self.initial_config = config
        self.stats = MockStats(recorded=deque(maxlen=config.record_requests))
        self._connections: set[HttpConnection] = set()
        self._ids = itertools.count(1)
        self._started = int(time.time())
        self._listener: Listener | None = None
        self._relisten: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task[None]] = set()
        # Requests waiting for one of the --slots, in arrival order.
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        # POST /_mock/hold: how many more requests in a slot are held, and
        # the ones held (released together when the last of them arrives).
        self._hold_left = 0
        self._held: list[asyncio.Future[None]] = []
        self.memory: NodeMemory | None = None
        self._apply_config(config)

    # Lifecycle

    async def start(self, host: str, port: int, refuse_ms: float | None) -> str:
        """Bind (and unless refusing, listen); return the base URL."""
        loop = asyncio.get_running_loop()
        self._listener = Listener(host, port, lambda: HttpConnection(self))
        self._listener.bind()
        if refuse_ms is None:
            await self._listener.listen()
        elif refuse_ms > 0:
            self._relisten = loop.call_later(refuse_ms / 1000, self.listen_again)
        return self._listener.url

    def listen_again(self) -> None:
        """Accept connections again after refusing them."""
        if self._relisten is not None:
            self._relisten.cancel()
            self._relisten = None
        if self._listener is not None:
            task = asyncio.get_running_loop().create_task(self._listen())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _listen(self) -> None:
        assert self._listener is not None
        try:
            await self._listener.listen()
        except OSError as error:
            # Another process took the port while we refused; say so and stay down.
            logger.error("Mock backend cannot listen again: %s", error)

    def refuse(self, duration_ms: float | None) -> None:
        """Refuse connections for ``duration_ms`` (None: until listen_again()).

        Open connections are closed too, after any response in progress, as they
        would be if the backend went down.
        """
        if self._listener is None:
            return
        self._listener.refuse()
        for conn in list(self._connections):
            conn.close_after_response = True
            if conn.is_idle:
                conn.close()
        if self._relisten is not None:
            self._relisten.cancel()
            self._relisten = None
        if duration_ms is not None:
            loop = asyncio.get_running_loop()
            self._relisten = loop.call_later(duration_ms / 1000, self.listen_again)

    def stop(self) -> None:
        """Close the listener and drop every connection at once."""
        if self._relisten is not None:
            self._relisten.cancel()
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._connections):
            conn.abort()

    # HttpApp interface

    def connection_opened(self, conn: HttpConnection) -> None:
        self._connections.add(conn)
        self.stats.open_connections += 1
        self.stats.connections_total += 1

    def connection_closed(self, conn: HttpConnection) -> None:
        self._connections.discard(conn)
        self.stats.open_connections -= 1

    def render_error(self, status: int, message: str) -> tuple[bytes, list[Header]]:
        return ApiError(status, message).render(), self._headers

    def handle(
        self, request: Request, conn: HttpConnection
    ) -> Coroutine[Any, Any, None] | None:
        """Answer a request now, or return a coroutine that will."""
        if request.path.startswith(CONTROL_PREFIX):
            self._handle_control(request, conn)
            return None
        config = self.config
        stats = self.stats
        stats.requests[request.path] += 1
        record = None
        if config.record_requests:
            record = RecordedRequest(
                request.method,
                request.target,
                request.headers,
                request.body,
                time.time(),
            )
            stats.recorded.append(record)
        headers = self._headers
        request_id = request.headers.get("x-request-id")
        if request_id is not None:
            headers = [*headers, ("X-Mock-Request-Id", request_id)]
        reply: bytes | _Stream | ApiError
        try:
            reply = self._answer(request, config)
        except ApiError as error:
            reply = error
        status = 200 if isinstance(reply, _Stream) else _status_of(reply)
        stats.responses[status] += 1
        if record is not None:
            record.status = status
        slotted = config.slots > 0 and (
            request.path in _SLOTTED_PATHS
            or (config.kind == "ollama" and request.path in OLLAMA_INFERENCE_PATHS)
        )
        memory = self.memory
        if memory is not None and status == 200:
            wanted = _model_wanted(request)
            if wanted is not None:
                return self._deliver_loaded(
                    memory, wanted, conn, reply, headers, config, slotted
                )
        if slotted:
            return self._deliver_in_slot(conn, reply, headers, config)
        # Answer without a task when nothing has to wait: benchmarks live here.
        if config.latency_ms <= 0:
            if not isinstance(reply, _Stream):
                self._send(conn, reply, headers)
                return None
            if config.chunk_delay_ms <= 0 and config.drop_after_chunks is None:
                chunks = [*reply.blocks, reply.tail]
                conn.send_stream(200, reply.content_type, headers, chunks)
                return None
        return self._deliver(conn, reply, headers, config)

    # Answers

    def _answer(self, request: Request, config: MockConfig) -> bytes | _Stream:
        if config.kind == "ollama" and request.path in OLLAMA_INFERENCE_PATHS:
            return self._answer_ollama(request, config)
        if self.memory is not None and request.path == "/api/ps":
            return self._answer_ps(request, config, self.memory)
        if config.kind == "anthropic" and request.path.startswith("/v1/messages"):
            return self._answer_messages(request, config)
        if config.kind != "openai":
            kind_reply = answer_kind_request(request, config, self._started)
            if kind_reply is not None:
                return kind_reply
        if config.api_key is not None:
            self._check_api_key(request, config.api_key)
        path = request.path
        if path == "/v1/models" or path.startswith("/v1/models/"):
            _require_method(request, "GET")
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
            return encode_json(self._describe_model(model_id))
        if path not in _INFERENCE_PATHS:
            raise ApiError(404, f"Invalid URL ({request.method} {path})")
        _require_method(request, "POST")
        payload = parse_json_object(request.body)
        job: Generation | EmbeddingJob
        if path == "/v1/embeddings":
            job = parse_embedding_request(payload, config.models, config.embedding_dim)
        elif path == "/v1/chat/completions":
            job = parse_chat_request(payload, config.name, config.models)
        else:
            job = parse_completion_request(payload, config.name, config.models)
        self._inject_failure(config)
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
            return reply if isinstance(reply, bytes) else _Stream(*reply)
        if job.stream:
            return _Stream(*render_stream(job, completion_id, created, config.chunks))
        return render_generation(job, completion_id, created)

    def _answer_ollama(self, request: Request, config: MockConfig) -> bytes | _Stream:
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
        try:
            self._inject_failure(config)
        except ApiError as error:
            raise ollama_error(error.status, error.message) from None
        if not isinstance(job, EmbeddingJob) and is_ollama_stream(job):
            blocks, tail = render_ollama_stream(job, config.chunks)
            return _Stream(blocks, tail, NDJSON_CONTENT_TYPE)
        return render_ollama_reply(job, request.path)

    def _answer_messages(self, request: Request, config: MockConfig) -> bytes | _Stream:
        check_anthropic_headers(request, config)
        _require_method(request, "POST")
        if request.path == "/v1/messages/count_tokens":
            return count_tokens(request.body, config.models)
        if request.path != "/v1/messages":
            raise anthropic_error(404, "Not found")
        try:
            self._inject_failure(config)
        except ApiError as error:
            raise anthropic_error(error.status, error.message) from None
        reply = answer_messages(
            request.body,
            config.name,
            config.models,
            config.chunks,
            config.tool_arguments,
        )
        return reply if isinstance(reply, bytes) else _Stream(*reply)

    def _check_api_key(self, request: Request, api_key: str) -> None:
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

    def _inject_failure(self, config: MockConfig) -> None:
        rate = config.error_rate
        if rate <= 0 or (rate < 1 and self._rng.random() >= rate):
            return
        self.stats.injected_failures += 1
        raise ApiError(
            config.fail_status,
            f"Injected failure: mock backend '{config.name}' answers "
            f"{config.fail_status} to {rate:.0%} of inference requests.",
            code="mock_injected_failure",
        )

    def _send(
        self, conn: HttpConnection, reply: bytes | ApiError, headers: list[Header]
    ) -> None:
        if isinstance(reply, ApiError):
            conn.send(reply.status, reply.render(), [*headers, *reply.headers])
        else:
            conn.send(200, reply, headers)

    async def _deliver(
        self,
        conn: HttpConnection,
        reply: bytes | ApiError | _Stream,
        headers: list[Header],
        config: MockConfig,
    ) -> None:
        self.stats.in_flight += 1
        try:
            if not await conn.sleep(config.latency_ms / 1000):
                self.stats.client_disconnects += 1
                return
            if isinstance(reply, _Stream):
                await self._stream(conn, reply, headers, config)
            else:
                self._send(conn, reply, headers)
        finally:
            self.stats.in_flight -= 1

    async def _deliver_loaded(
        self,
        memory: NodeMemory,
        wanted: tuple[str, float | None, bool],
        conn: HttpConnection,
        reply: bytes | ApiError | _Stream,
        headers: list[Header],
        config: MockConfig,
        slotted: bool,
    ) -> None:
        """Load the model if it is not (as Ollama's scheduler does), then answer.

        A request that only loads the model (no prompt) takes no slot.
        """
        model, keep_alive, load_only = wanted
        await memory.acquire(model, keep_alive, load_only=load_only)
        try:
            if slotted and not load_only:
                await self._deliver_in_slot(conn, reply, headers, config)
            else:
                await self._deliver(conn, reply, headers, config)
        finally:
            memory.release(model)

    def _answer_ps(
        self, request: Request, config: MockConfig, memory: NodeMemory
    ) -> bytes:
        check_bearer(request, config, ollama=True)
        if request.method not in ("GET", "HEAD"):
            raise ollama_error(405, "method not allowed")
        return encode_json(
            {
                "models": [
                    {**describe_ollama_tag(config, entry["name"]), **entry}
                    for entry in memory.ps(config.context_length)
                    if entry["name"] in config.models
                ]
            }
        )

    async def _deliver_in_slot(
        self,
        conn: HttpConnection,
        reply: bytes | ApiError | _Stream,
        headers: list[Header],
        config: MockConfig,
    ) -> None:
        """Wait for a free slot (in arrival order), then answer as usual."""
        stats = self.stats
        if stats.busy_slots < config.slots and not self._slot_waiters:
            stats.busy_slots += 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(turn)
            stats.waiting_for_slot += 1
            stats.note_slots()
            try:
                got_slot = await conn.wait_for(turn)
            finally:
                stats.waiting_for_slot -= 1
                if not turn.done():
                    turn.cancel()
                    self._slot_waiters.remove(turn)
            if not got_slot:
                stats.client_disconnects += 1
                return
        stats.note_slots()
        try:
            if self._hold_left and not await self._hold(conn):
                stats.client_disconnects += 1
                return
            await self._deliver(conn, reply, headers, config)
        finally:
            self._free_slot()

    async def _hold(self, conn: HttpConnection) -> bool:
        """Hold this request (in its slot) until the last of those that
        POST /_mock/hold asked for arrives, /_mock/release, or HOLD_SECONDS;
        False if the client left meanwhile."""
        self._hold_left -= 1
        if not self._hold_left:
            self._release_held()
            return True
        held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.append(held)
        timer = asyncio.get_running_loop().call_later(HOLD_SECONDS, _resolve, held)
        try:
            return await conn.wait_for(held)
        finally:
            timer.cancel()

    def _release_held(self) -> None:
        self._hold_left = 0
        held, self._held = self._held, []
        for future in held:
            _resolve(future)

    def _free_slot(self) -> None:
        # The slot passes straight to the oldest waiter, if there is one.
        waiters = self._slot_waiters
        while waiters:
            turn = waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.stats.busy_slots -= 1

    async def _stream(
        self,
        conn: HttpConnection,
        reply: _Stream,
        headers: list[Header],
        config: MockConfig,
    ) -> None:
        drop_after = config.drop_after_chunks
        delay = config.chunk_delay_ms / 1000
        conn.start_stream(200, reply.content_type, headers)
        for index, block in enumerate(reply.blocks):
            if drop_after is not None and index >= drop_after:
                conn.cut()
                self.stats.dropped_streams += 1
                return
            if index and delay > 0:
                await conn.sleep(delay)
            if not conn.is_open:
                self.stats.client_disconnects += 1
                return
            conn.send_chunk(block)
            await conn.drain()
        if not conn.is_open:
            self.stats.client_disconnects += 1
            return
        conn.send_chunk(reply.tail)
        if drop_after is not None:
            conn.cut()
            self.stats.dropped_streams += 1
            return
        conn.end_stream()

    # Control API

    def _handle_control(self, request: Request, conn: HttpConnection) -> None:
        route = request.path[len(CONTROL_PREFIX) :].rstrip("/")
        refuse_for: float | None = None
        refuse_forever = False
        try:
            if route == "stats":
                _require_method(request, "GET")
                body = self.describe_stats()
            elif route == "config" and request.method == "GET":
                body = self.describe_config()
            elif route == "config":
                _require_method(request, "POST", "GET")
                changes = parse_json_object(request.body)
                refuse_for, refuse_forever = _pop_refuse(changes)
                self._change_config(changes)
                body = self.describe_config()
            elif route == "hold":
                # {"first": N}: hold the next N requests that get a slot until
                # the Nth arrives, so that a test sees them at the mock at once
                # however slowly a loaded machine sends them.
                _require_method(request, "POST")
                first = parse_json_object(request.body).get("first")
                if not isinstance(first, int) or isinstance(first, bool) or first < 1:
                    raise ApiError(400, "first must be a positive integer.")
                self._release_held()
                self._hold_left = first
                body = {"holding": first}
            elif route == "release":
                _require_method(request, "POST")
                body = {"released": len(self._held)}
                self._release_held()
            elif route == "reset":
                _require_method(request, "POST")
                self._release_held()
                self.stats.reset()
                self.memory = None
                self._apply_config(self.initial_config)
                body = self.describe_config()
            else:
                raise ApiError(404, f"Invalid URL ({request.method} {request.path})")
        except ApiError as error:
            conn.send(error.status, error.render(), [*self._headers, *error.headers])
            return
        refusing = refuse_forever or refuse_for is not None
        if refusing:
            body["listening"] = False
            conn.close_after_response = True
        conn.send(200, encode_json(body), self._headers)
        if refusing:
            self.refuse(refuse_for)

    def _change_config(self, changes: dict[str, Any]) -> None:
        try:
            config = self.config.updated(changes)
        except ConfigError as error:
            raise ApiError(400, str(error), param=error.knob) from None
        self._apply_config(config, reseed="seed" in changes)

    def _apply_config(self, config: MockConfig, reseed: bool = True) -> None:
        previous = getattr(self, "config", None)
        self.config = config
        if not config.has_memory:
            self.memory = None
        elif (
            self.memory is None
            or previous is None
            or _memory_knobs(previous) != _memory_knobs(config)
        ):
            self.memory = _new_memory(config)
        if reseed:
            self._rng = random.Random(config.seed)
        if self.stats.recorded.maxlen != config.record_requests:
            self.stats.recorded = deque(
                self.stats.recorded, maxlen=config.record_requests
            )
        self._headers: list[Header] = [("X-Mock-Backend", config.name)]
        self._models_body = encode_json(
            {
                "object": "list",
                "data": [self._describe_model(model) for model in config.models],
            }
        )

    def _describe_model(self, model: str) -> dict[str, Any]:
        return describe_model(self.config, model, self._started)

    def describe_config(self) -> dict[str, Any]:
        """Return the effective configuration, and whether connections are taken."""
        listening = self._listener is not None and self._listener.is_listening
        return {**self.config.as_dict(), "listening": listening}

    def describe_stats(self) -> dict[str, Any]:
        """Return the stats as JSON-ready values."""
        stats = {"name": self.config.name, **self.stats.as_dict()}
        if self.memory is not None:
            stats.update(self.memory.as_dict())
        return stats


def _require_method(request: Request, *allowed: str) -> None:
    if request.method not in allowed:
        raise ApiError(
            405,
            f"Method {request.method} is not allowed for {request.path}; use "
            f"{' or '.join(allowed)}.",
            headers=(("Allow", ", ".join(allowed)),),
        )


def _pop_refuse(changes: dict[str, Any]) -> tuple[float | None, bool]:
    """Take the refuse actions out of a config change; they are not knobs."""
    refuse_for = changes.pop("refuse_for_ms", None)
    refuse = changes.pop("refuse", False)
    if refuse_for is not None and (
        isinstance(refuse_for, bool)
        or not isinstance(refuse_for, int | float)
        or not 0 < refuse_for <= 3_600_000
    ):
        raise ApiError(
            400,
            "refuse_for_ms must be a number of milliseconds from 1 to 3600000.",
            param="refuse_for_ms",
        )
    if not isinstance(refuse, bool):
        raise ApiError(400, "refuse must be a boolean.", param="refuse")
    return refuse_for, refuse


def _memory_knobs(config: MockConfig) -> tuple[Any, ...]:
    return (
        config.models,
        config.model_sizes,
        config.memory_gb,
        config.load_seconds,
        config.keep_alive_seconds,
        config.loaded_models,
    )


def _new_memory(config: MockConfig) -> NodeMemory:
    memory = NodeMemory(
        sizes=dict(config.model_sizes),
        ceiling_gb=config.memory_gb,
        load_seconds=config.load_seconds,
        keep_alive_seconds=config.keep_alive_seconds,
    )
    memory.preload(
        config.models if config.loaded_models is None else config.loaded_models
    )
    return memory


def _model_wanted(request: Request) -> tuple[str, float | None, bool] | None:
    """(model, keep_alive, load only) of an inference request, if it names one."""
    if request.path not in OLLAMA_INFERENCE_PATHS and request.path not in (
        _INFERENCE_PATHS
    ):
        return None
    try:
        payload = parse_json_object(request.body)
    except ApiError:
        return None
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        return None
    load_only = (request.path == "/api/generate" and not payload.get("prompt")) or (
        request.path == "/api/chat" and not payload.get("messages")
    )
    return model, parse_keep_alive(payload.get("keep_alive")), load_only


def _status_of(reply: bytes | ApiError) -> int:
    return reply.status if isinstance(reply, ApiError) else 200


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
