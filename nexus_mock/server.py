"""The mock backend's server: connections, the delivery of replies, live settings.

``MockBackend`` listens (or refuses connections, as a backend that is down),
records each request in its stats, gets the reply from ``nexus_mock.answers``
and delivers it the way the knobs say: after ``latency_ms``, streamed with
``chunk_delay_ms`` between blocks or cut after ``drop_after_chunks``, in one of
the ``--slots`` (``nexus_mock.slots``), and after loading the model into the
node's memory when ``memory_gb`` is set. It also holds the live configuration
that the control API (``nexus_mock.control``) reads and changes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from nexus_mock.answers import INFERENCE_PATHS, Answers, Stream
from nexus_mock.config import ConfigError, MockConfig
from nexus_mock.control import CONTROL_PREFIX, answer_control
from nexus_mock.http_parsing import Request
from nexus_mock.jobs import ApiError, parse_json_object
from nexus_mock.kinds import check_bearer
from nexus_mock.listener import Listener
from nexus_mock.memory import LoadRefused, NodeMemory, parse_keep_alive
from nexus_mock.ollama_api import INFERENCE_PATHS as OLLAMA_INFERENCE_PATHS
from nexus_mock.ollama_models import (
    BLOBS_PREFIX,
    MANAGEMENT_PATHS,
    ManagedModels,
    answer_blob,
    answer_management,
)
from nexus_mock.prefix_cache import PrefixCache
from nexus_mock.protocol import Header, HttpConnection
from nexus_mock.replies import encode_json
from nexus_mock.slots import Slots
from nexus_mock.stats import MockStats, RecordedRequest

logger = logging.getLogger(__name__)

# Also held to --slots (what a model server runs).
_SLOTTED_PATHS = (*INFERENCE_PATHS, "/v1/messages")


class MockBackend:
    """An OpenAI-compatible model server that echoes, on purpose, what it is asked."""

    def __init__(self, config: MockConfig) -> None:
        self.initial_config = config
        self.stats = MockStats(recorded=deque(maxlen=config.record_requests))
        self._connections: set[HttpConnection] = set()
        self._started = int(time.time())
        self._listener: Listener | None = None
        self._relisten: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._answers = Answers(self.stats, self._started)
        self.slots = Slots(self.stats)
        # Digests of the Ollama model files uploaded (/api/blobs).
        self.blobs: set[str] = set()
        self.prefix_cache = PrefixCache()
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
        if config.kind == "ollama" and request.path in MANAGEMENT_PATHS:
            return self._manage(request, conn, headers, record)
        if config.kind == "ollama" and request.path.startswith(BLOBS_PREFIX):
            self._blob(request, conn, headers, record)
            return None
        reply: bytes | Stream | ApiError
        try:
            if (
                config.kind == "vllm"
                and config.prefix_block_chars
                and request.path == "/metrics"
            ):
                reply = self.prefix_cache.vllm_metrics(config)
            else:
                reply = self._answers.answer(request, config, self.memory)
        except ApiError as error:
            reply = error
        status = 200 if isinstance(reply, Stream) else _status_of(reply)
        stats.responses[status] += 1
        if record is not None:
            record.status = status
        slotted = config.slots > 0 and (
            request.path in _SLOTTED_PATHS
            or (config.kind == "ollama" and request.path in OLLAMA_INFERENCE_PATHS)
        )
        memory = self.memory
        # A prompt's prefill: its tokens estimated as the body's bytes / 4.
        prompt_seconds = config.prefill_ms_per_1k_tokens * len(request.body) / 4e6
        if (
            config.slow_rate > 0
            and status == 200
            and request.path in _SLOTTED_PATHS
            and self._slow_rng.random() < config.slow_rate
        ):
            stats.slow_requests += 1
            prompt_seconds += config.slow_ms / 1000
        prefill: float | Callable[[], float] = prompt_seconds
        if (
            config.prefix_block_chars
            and status == 200
            and request.path in _SLOTTED_PATHS
        ):
            # Read when the request starts computing (in its slot): what the
            # prompt cache holds then.
            headers = [*headers]  # the hits go onto this request's answer
            prefill = self._prefill_with_cache(
                request.body, prompt_seconds, headers, request_id
            )
        if memory is not None and status == 200:
            wanted = _model_wanted(request)
            if wanted is not None:
                native = request.path in OLLAMA_INFERENCE_PATHS
                return self._deliver_loaded(
                    memory,
                    wanted,
                    conn,
                    reply,
                    headers,
                    config,
                    slotted,
                    native,
                    prefill,
                )
        if slotted:
            return self._deliver_in_slot(conn, reply, headers, config, prefill)
        # Answer without a task when nothing has to wait: benchmarks live here.
        if config.latency_ms <= 0 and not callable(prefill) and prefill <= 0:
            if not isinstance(reply, Stream):
                self._send(conn, reply, headers)
                return None
            if config.chunk_delay_ms <= 0 and config.drop_after_chunks is None:
                chunks = [*reply.blocks, reply.tail]
                conn.send_stream(200, reply.content_type, headers, chunks)
                return None
        return self._answer(conn, reply, headers, config, prefill)

    async def _answer(
        self,
        conn: HttpConnection,
        reply: bytes | ApiError | Stream,
        headers: list[Header],
        config: MockConfig,
        prefill: float | Callable[[], float],
    ) -> None:
        await self._deliver(conn, reply, headers, config, prefill)

    def _prefill_with_cache(
        self,
        body: bytes,
        prefill: float,
        headers: list[Header],
        request_id: str | None,
    ) -> Callable[[], float]:
        """The prefill in seconds, plus the prompt blocks the cache lacks; the
        answer says ``X-Mock-Prefix-Blocks: <held>/<total>``."""

        def seconds() -> float:
            config = self.config
            held, total = self.prefix_cache.compute(
                body, config.prefix_block_chars, config.prefix_cache_blocks, request_id
            )
            headers.append(("X-Mock-Prefix-Blocks", f"{held}/{total}"))
            return prefill + (total - held) * config.prefix_block_ms / 1000

        return seconds

    # Ollama's model management (nexus_mock.ollama_models)

    def _manage(
        self,
        request: Request,
        conn: HttpConnection,
        headers: list[Header],
        record: RecordedRequest | None,
    ) -> Coroutine[Any, Any, None] | None:
        """Pull, push, copy, create or delete a model; the list changes after."""
        config = self.config
        try:
            check_bearer(request, config, ollama=True)
            managed = answer_management(request, config.models, self.blobs)
        except ApiError as error:
            self._count(record, error.status)
            self._send(conn, error, headers)
            return None
        self._count(record, 200)
        if managed.body is not None:
            self._set_models(managed.after)
            conn.send(200, managed.body, headers)
            return None
        return self._deliver_managed(conn, managed, headers, config)

    def _blob(
        self,
        request: Request,
        conn: HttpConnection,
        headers: list[Header],
        record: RecordedRequest | None,
    ) -> None:
        """Answer whether the node has a model file, or store one."""
        try:
            check_bearer(request, self.config, ollama=True)
            status, body = answer_blob(request, self.blobs)
        except ApiError as error:
            self._count(record, error.status)
            self._send(conn, error, headers)
            return
        self._count(record, status)
        if request.method == "POST":
            self.stats.blob_bytes += len(request.body)
        conn.send(status, body, headers)

    async def _deliver_managed(
        self,
        conn: HttpConnection,
        managed: ManagedModels,
        headers: list[Header],
        config: MockConfig,
    ) -> None:
        """Stream a pull's or create's progress, or wait as long and send its
        last line; the model exists once the answer is sent."""
        *blocks, tail = managed.lines
        if managed.stream:
            reply = Stream(blocks, tail, managed.content_type)
            if not await self._deliver(conn, reply, headers, config):
                return  # its client left (Ctrl-C): Ollama stops, no model
        else:
            pause = config.chunk_delay_ms / 1000 * len(blocks)
            if pause > 0 and not await conn.sleep(pause):
                self.stats.client_disconnects += 1
                return
            self._send(conn, tail.rstrip(b"\n"), headers)
        self._set_models(managed.after)

    def _set_models(self, models: tuple[str, ...] | None) -> None:
        # Not through the knobs: deleting a node's last model leaves it empty.
        if models is not None and models != self.config.models:
            self._apply_config(dataclasses.replace(self.config, models=models), False)

    def _count(self, record: RecordedRequest | None, status: int) -> None:
        self.stats.responses[status] += 1
        if record is not None:
            record.status = status

    # Delivery

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
        reply: bytes | ApiError | Stream,
        headers: list[Header],
        config: MockConfig,
        prefill: float | Callable[[], float] = 0.0,
    ) -> bool:
        """Answer; return whether the whole answer went out (its client
        stayed)."""
        self.stats.in_flight += 1
        try:
            seconds = prefill() if callable(prefill) else prefill
            if not await conn.sleep(config.latency_ms / 1000 + seconds):
                self.stats.client_disconnects += 1
                return False
            if isinstance(reply, Stream):
                return await self._stream(conn, reply, headers, config)
            self._send(conn, reply, headers)
            return True
        finally:
            self.stats.in_flight -= 1

    async def _deliver_loaded(
        self,
        memory: NodeMemory,
        wanted: tuple[str, float | None, bool],
        conn: HttpConnection,
        reply: bytes | ApiError | Stream,
        headers: list[Header],
        config: MockConfig,
        slotted: bool,
        native: bool,
        prefill: float | Callable[[], float],
    ) -> None:
        """Load the model if it is not (as Ollama's scheduler does), then answer.

        A request that only loads the model (no prompt) takes no slot. A load
        that does not fit (``oom_loads``) answers Ollama's 500 instead.
        """
        model, keep_alive, load_only = wanted
        try:
            await memory.acquire(model, keep_alive, load_only=load_only)
        except LoadRefused as refused:
            # Ollama's answer, on its native and OpenAI-compatible paths alike.
            self.stats.responses[200] -= 1
            self.stats.responses[500] += 1
            self._send(conn, refused.as_error(native=native), headers)
            return
        try:
            if slotted and not load_only:
                await self._deliver_in_slot(conn, reply, headers, config, prefill)
            else:
                await self._deliver(conn, reply, headers, config, prefill)
        finally:
            memory.release(model)

    async def _deliver_in_slot(
        self,
        conn: HttpConnection,
        reply: bytes | ApiError | Stream,
        headers: list[Header],
        config: MockConfig,
        prefill: float | Callable[[], float] = 0.0,
    ) -> None:
        """Wait for a free slot (in arrival order), then answer as usual."""
        if not await self.slots.acquire(conn, config.slots):
            self.stats.client_disconnects += 1
            return
        try:
            if not await self.slots.hold(conn):
                self.stats.client_disconnects += 1
                return
            await self._deliver(conn, reply, headers, config, prefill)
        finally:
            self.slots.release()

    async def _stream(
        self,
        conn: HttpConnection,
        reply: Stream,
        headers: list[Header],
        config: MockConfig,
    ) -> bool:
        """Send the stream; return whether it went out whole."""
        drop_after = config.drop_after_chunks
        delay = config.chunk_delay_ms / 1000
        conn.start_stream(200, reply.content_type, headers)
        for index, block in enumerate(reply.blocks):
            if drop_after is not None and index >= drop_after:
                conn.cut()
                self.stats.dropped_streams += 1
                return False
            if index and delay > 0:
                await conn.sleep(delay)
            if not conn.is_open:
                self.stats.client_disconnects += 1
                return False
            conn.send_chunk(block)
            await conn.drain()
        if not conn.is_open:
            self.stats.client_disconnects += 1
            return False
        conn.send_chunk(reply.tail)
        if drop_after is not None:
            conn.cut()
            self.stats.dropped_streams += 1
            return False
        conn.end_stream()
        return True

    # Control API

    def _handle_control(self, request: Request, conn: HttpConnection) -> None:
        try:
            body, refuse_for, refuse_forever = answer_control(self, request)
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

    # Configuration

    def change_config(self, changes: dict[str, Any]) -> None:
        """Apply knob changes (raise ApiError for a bad one)."""
        try:
            config = self.config.updated(changes)
        except ConfigError as error:
            raise ApiError(400, str(error), param=error.knob) from None
        self._apply_config(config, reseed="seed" in changes)

    def reset(self) -> None:
        """Go back to the start-up configuration, with zeroed counters."""
        self.slots.release_held()
        self.stats.reset()
        self.prefix_cache.reset()
        self.memory = None
        self._apply_config(self.initial_config)

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
        if self.memory is not None:
            # Changed in place: the models loaded stay loaded.
            self.memory.resident = dict(config.resident_models)
            self.memory.oom_loads = config.oom_loads
        if self.stats.recorded.maxlen != config.record_requests:
            self.stats.recorded = deque(
                self.stats.recorded, maxlen=config.record_requests
            )
        self._headers: list[Header] = [("X-Mock-Backend", config.name)]
        self._answers.configure(config, reseed=reseed)
        if reseed or not hasattr(self, "_slow_rng"):
            self._slow_rng = random.Random(config.seed)

    def describe_config(self) -> dict[str, Any]:
        """Return the effective configuration, and whether connections are taken."""
        listening = self._listener is not None and self._listener.is_listening
        return {**self.config.as_dict(), "listening": listening}

    def describe_stats(self) -> dict[str, Any]:
        """Return the stats as JSON-ready values."""
        stats = {
            "name": self.config.name,
            **self.stats.as_dict(),
            **self.prefix_cache.as_dict(),
        }
        if self.memory is not None:
            stats.update(self.memory.as_dict())
        return stats


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
    if (
        request.path not in OLLAMA_INFERENCE_PATHS
        and request.path not in INFERENCE_PATHS
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
