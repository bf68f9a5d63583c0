"""The worker daemon against a fake gateway, with the mock backend as its local server.

``FakeGateway`` is a small aiohttp WebSocket server that plays the gateway's side
of ``nexus_worker.protocol``; the tests drive it message by message. The worker
runs in this event loop (``Worker.run()``) or, where the exit status and signals
matter, as the real ``python -m nexus_worker`` process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web

from nexus_mock import MockBackendProcess
from nexus_worker.daemon import Backoff, Worker, WorkerConfig
from nexus_worker.protocol import (
    ERROR_AT_CAPACITY,
    ERROR_BACKEND_UNAVAILABLE,
    ERROR_DRAINING,
    ERROR_ENDPOINT_NOT_ALLOWED,
    ERROR_RESPONSE_TOO_LARGE,
    MAX_CHUNK_CHARS,
    SECRET_HEADER,
    Cancel,
    CloseCode,
    Error,
    GracefulShutdown,
    Message,
    ModelsRefresh,
    ModelsUpdate,
    Ping,
    Pong,
    Register,
    RegisterAck,
    Request,
    ResponseChunk,
    ResponseComplete,
    decode,
    encode,
)
from tests.conftest import REPO_ROOT, start_mock_backend

SECRET = "worker-secret-for-tests"
WAIT = 15.0
M = TypeVar("M")


class Peer:
    """One worker connection as the gateway sees it."""

    def __init__(self, ws: web.WebSocketResponse, name: str | None) -> None:
        self.ws = ws
        self.name = name
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = asyncio.Event()

    async def send(self, message: Message) -> None:
        await self.ws.send_str(encode(message))

    async def next(self, timeout: float = WAIT) -> Any:
        """Return the next message the worker sent."""
        return await asyncio.wait_for(self.inbox.get(), timeout)

    async def expect(self, kind: type[M], timeout: float = WAIT) -> M:
        """Return the next message; it must be of ``kind``."""
        message = await self.next(timeout)
        assert isinstance(message, kind), message
        return message

    async def register(self, **ack: Any) -> Register:
        """Take the worker's register and acknowledge it."""
        register = await self.expect(Register)
        ack.setdefault("heartbeat_interval", 5.0)
        await self.send(
            RegisterAck(worker_id=f"w-{register.name}", models=register.models, **ack)
        )
        return register

    async def response(self, request_id: str) -> tuple[list[str], ResponseComplete]:
        """Collect a request's chunks up to its response_complete."""
        chunks: list[str] = []
        while True:
            message = await self.next()
            assert isinstance(message, ResponseChunk | ResponseComplete), message
            assert message.request_id == request_id
            if isinstance(message, ResponseComplete):
                return chunks, message
            chunks.append(message.chunk)


class FakeGateway:
    """Plays the gateway: checks the secret, hands each connection to the test."""

    def __init__(self) -> None:
        self.secret = SECRET
        self.refuse_with_403 = False
        self.peers: asyncio.Queue[Peer] = asyncio.Queue()
        self.attempts: list[float] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/prefix/ws/workers/", self._connect)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/prefix"

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def next_peer(self, timeout: float = WAIT) -> Peer:
        return await asyncio.wait_for(self.peers.get(), timeout)

    async def _connect(self, request: web.Request) -> web.StreamResponse:
        self.attempts.append(time.monotonic())
        accepted = request.headers.get(SECRET_HEADER) == self.secret
        if not accepted and self.refuse_with_403:
            return web.Response(status=403)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        if not accepted:
            await ws.close(code=CloseCode.AUTH_FAILED)
            return ws
        peer = Peer(ws, request.query.get("name"))
        self.peers.put_nowait(peer)
        async for frame in ws:
            peer.inbox.put_nowait(decode(frame.data))
        peer.closed.set()
        return ws


@pytest.fixture(scope="module")
def local_backend() -> Iterator[MockBackendProcess]:
    """The worker's local model server (reset before each test)."""
    backend = start_mock_backend(
        "--models", "llama3:8b,mistral:7b", "--name", "gpu", "--chunks", "5"
    )
    yield backend
    backend.stop()


@pytest.fixture
async def backend(local_backend: MockBackendProcess) -> MockBackendProcess:
    await _mock_post(local_backend, "/_mock/reset", {})
    return local_backend


@pytest.fixture
async def gateway() -> AsyncIterator[FakeGateway]:
    gateway = FakeGateway()
    await gateway.start()
    yield gateway
    await gateway.stop()


class RunningWorker:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.task = asyncio.create_task(worker.run())


@pytest.fixture
async def start_worker(
    gateway: FakeGateway, backend: MockBackendProcess
) -> AsyncIterator[Any]:
    """Run workers in this event loop; stop them (at once) after the test."""
    running: list[RunningWorker] = []

    def start(**overrides: Any) -> Worker:
        options: dict[str, Any] = {
            "server": gateway.url,
            "secret": SECRET,
            "backend": backend.base_url,
            "name": "gpu-1",
            "backoff_first_secs": 0.2,
            "backoff_jitter_secs": 0.05,
            **overrides,
        }
        worker = Worker(WorkerConfig(**options))
        running.append(RunningWorker(worker))
        return worker

    yield start
    for item in running:
        if not item.task.done():
            item.worker.drain(0.0)
        await asyncio.wait_for(item.task, WAIT)


def chat_request(request_id: str, *, stream: bool, **extra: Any) -> Request:
    body = {
        "model": "llama3:8b",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
    }
    return Request(
        request_id=request_id,
        model="llama3:8b",
        endpoint="/v1/chat/completions",
        body=json.dumps(body),
        headers={"content-type": "application/json", **extra.pop("headers", {})},
        is_streaming=stream,
        **extra,
    )


async def _mock_post(
    backend: MockBackendProcess, path: str, payload: dict[str, Any]
) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.post(backend.base_url + path, json=payload) as response,
    ):
        assert response.status == 200, await response.text()
        return await response.json()


async def _mock_stats(backend: MockBackendProcess) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(backend.base_url + "/_mock/stats") as response,
    ):
        return dict(await response.json())


async def _wait_for(condition: Any, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _content(sse_text: str) -> str:
    """Join the content deltas of an OpenAI chat stream."""
    text = ""
    for line in sse_text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


async def test_registers_with_the_local_models_and_capacity(
    gateway: FakeGateway, start_worker: Any
) -> None:
    start_worker(max_concurrency=3)
    peer = await gateway.next_peer()
    register = await peer.register()
    assert peer.name == "gpu-1"
    assert register.name == "gpu-1"
    assert register.models == ["llama3:8b", "mistral:7b"]
    assert register.max_concurrency == 3
    assert register.load == 0
    assert register.backend_kind == "openai"
    assert register.protocol_version == 1


async def test_an_ollama_backend_is_listed_by_its_tags_and_served_natively(
    gateway: FakeGateway, start_worker: Any, mock_backend_factory: Any
) -> None:
    ollama = mock_backend_factory("--models", "qwen2.5:7b", "--kind", "ollama")
    start_worker(backend=ollama.base_url)
    peer = await gateway.next_peer()
    register = await peer.register()
    assert register.backend_kind == "ollama"
    assert register.models == ["qwen2.5:7b"]
    body = {"model": "qwen2.5:7b", "messages": [{"role": "user", "content": "yo"}]}
    await peer.send(
        Request(
            request_id="o1",
            model="qwen2.5:7b",
            endpoint="/api/chat",
            body=json.dumps(body),
            is_streaming=True,
        )
    )
    chunks, complete = await peer.response("o1")
    lines = [json.loads(line) for line in "".join(chunks).splitlines()]
    assert "".join(line["message"]["content"] for line in lines).endswith("echo: yo")
    assert lines[-1]["done"] is True
    assert complete.status == 200


def _heard(pong: Pong) -> tuple[float | None, int]:
    return pong.timestamp, pong.load


async def test_register_and_pongs_carry_what_the_backend_has_loaded(
    gateway: FakeGateway, start_worker: Any, mock_backend_factory: Any
) -> None:
    """The worker reads its Ollama's /api/ps, as the gateway's health round
    reads a direct backend's, and says what it read with its register and
    then every pong (with the memory it was told, as bytes)."""
    node = mock_backend_factory(
        "--kind", "ollama", "--model", "a:4", "--model", "b:2", "--loaded-models", "a"
    )
    start_worker(backend=node.base_url, backend_kind="ollama", memory_gb=24.0)
    peer = await gateway.next_peer()
    register = await peer.register(heartbeat_interval=0.2)
    assert register.state is not None
    assert register.state.memory_bytes == 24 * 10**9
    assert register.state.loaded is not None
    (loaded,) = register.state.loaded
    assert (loaded.name, loaded.vram_bytes) == ("a", 4 * 10**9)
    assert loaded.expires_in is not None and 0 < loaded.expires_in <= 300
    # b is loaded now: a later pong says so.
    await _mock_post(node, "/api/generate", {"model": "b", "prompt": ""})
    for attempt in range(100):
        await peer.send(Ping(timestamp=float(attempt)))
        pong = await peer.expect(Pong)
        assert pong.state is not None and pong.state.loaded is not None
        if {model.name for model in pong.state.loaded} == {"a", "b"}:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("no pong said b was loaded")


async def test_pong_echoes_the_timestamp_with_the_live_load(
    gateway: FakeGateway, start_worker: Any, backend: MockBackendProcess
) -> None:
    await _mock_post(backend, "/_mock/config", {"chunk_delay_ms": 300})
    worker = start_worker()
    peer = await gateway.next_peer()
    await peer.register()
    await peer.send(Ping(timestamp=1700000000.25))
    assert _heard(await peer.expect(Pong)) == (1700000000.25, 0)
    await peer.send(chat_request("r1", stream=True))
    await peer.expect(ResponseChunk)
    await peer.send(Ping(timestamp=2.0))
    assert _heard(await peer.expect(Pong)) == (2.0, 1)
    assert worker.load == 1


async def test_a_stream_comes_back_in_order_then_completes(
    gateway: FakeGateway, start_worker: Any
) -> None:
    start_worker()
    peer = await gateway.next_peer()
    await peer.register()
    await peer.send(chat_request("s1", stream=True))
    chunks, complete = await peer.response("s1")
    text = "".join(chunks)
    assert _content(text) == "[gpu/llama3:8b] echo: hi"
    assert text.rstrip().endswith("data: [DONE]")
    assert complete.status == 200
    assert complete.body is None
    assert complete.headers["content-type"].startswith("text/event-stream")


async def test_a_plain_request_comes_back_whole_in_response_complete(
    gateway: FakeGateway, start_worker: Any
) -> None:
    start_worker()
    peer = await gateway.next_peer()
    await peer.register()
    await peer.send(chat_request("p1", stream=False))
    chunks, complete = await peer.response("p1")
    assert chunks == []
    assert complete.status == 200
    assert complete.headers == {"content-type": "application/json"}
    assert complete.body is not None
    reply = json.loads(complete.body)
    assert reply["choices"][0]["message"]["content"] == "[gpu/llama3:8b] echo: hi"


async def test_backend_errors_pass_through_with_their_status(
    gateway: FakeGateway, start_worker: Any
) -> None:
    start_worker()
    peer = await gateway.next_peer()
    await peer.register()
    request = chat_request("e1", stream=True)
    body = json.loads(request.body) | {"model": "no-such-model"}
    await peer.send(
        Request(
            request_id="e1",
            model="no-such-model",
            endpoint=request.endpoint,
            body=json.dumps(body),
            is_streaming=True,
        )
    )
    chunks, complete = await peer.response("e1")
    assert chunks == []  # not a stream: the error comes whole
    assert complete.status == 404
    assert complete.body is not None
    assert "no-such-model" in json.loads(complete.body)["error"]["message"]


async def test_cancel_closes_the_backend_connection_at_once(
    gateway: FakeGateway, start_worker: Any, backend: MockBackendProcess
) -> None:
    await _mock_post(backend, "/_mock/config", {"chunks": 50, "chunk_delay_ms": 200})
    worker = start_worker()
    peer = await gateway.next_peer()
    await peer.register()
    await peer.send(chat_request("c1", stream=True))
    await peer.expect(ResponseChunk)
    assert (await _mock_stats(backend))["client_disconnects"] == 0
    await peer.send(Cancel(request_id="c1", reason="client disconnected"))
    cancelled_at = time.monotonic()

    async def backend_saw_the_disconnect() -> bool:
        return (await _mock_stats(backend))["client_disconnects"] == 1

    await _wait_for(backend_saw_the_disconnect)
    assert time.monotonic() - cancelled_at < 1.0
    assert worker.load == 0
    await peer.send(Ping(timestamp=3.0))
    # Nothing more for c1 (no chunk, no complete): the next frame is the pong.
    message = await peer.next()
    assert isinstance(message, Pong), message
    assert message.load == 0


async def test_endpoints_outside_the_allow_list_never_reach_the_backend(
    gateway: FakeGateway, start_worker: Any, backend: MockBackendProcess
) -> None:
    start_worker()
    peer = await gateway.next_peer()
    await peer.register()
    before = (await _mock_stats(backend))["requests_total"]
    for request_id, endpoint, method in [
        ("x1", "/_mock/reset", "POST"),
        ("x2", "/v1/chat/completions/../../_mock/reset", "POST"),
        ("x3", "/v1/chat/completions", "DELETE"),
    ]:
        await peer.send(
            Request(
                request_id=request_id,
                model="llama3:8b",
                endpoint=endpoint,
                body="{}",
                method=method,
            )
        )
        error = await peer.expect(Error)
        assert error.request_id == request_id
        assert error.code == ERROR_ENDPOINT_NOT_ALLOWED
    assert (await _mock_stats(backend))["requests_total"] == before


async def test_the_clients_authorization_stays_home_and_the_backend_key_is_added(
    gateway: FakeGateway, start_worker: Any, mock_backend_factory: Any
) -> None:
    locked = mock_backend_factory("--models", "llama3:8b", "--api-key", "local-key")
    start_worker(backend=locked.base_url, backend_key="local-key")
    peer = await gateway.next_peer()
    await peer.register()
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    headers = {
        "authorization": "Bearer client-key",
        "x-forwarded-for": "10.0.0.1",
        "traceparent": traceparent,  # the gateway's attempt span (docs/tracing.md)
        "tracestate": "vendor=1",
    }
    await peer.send(chat_request("k1", stream=False, headers=headers))
    _, complete = await peer.response("k1")
    assert complete.status == 200
    seen = (await _mock_stats(locked))["last_requests"][-1]["headers"]
    seen = {name.lower(): value for name, value in seen.items()}
    assert seen["authorization"] == "Bearer local-key"
    assert "x-forwarded-for" not in seen
    assert seen["traceparent"] == traceparent
    assert seen["tracestate"] == "vendor=1"


async def test_an_unreachable_backend_answers_502_in_openai_shape(
    gateway: FakeGateway, start_worker: Any
) -> None:
    start_worker(backend="http://127.0.0.1:9")  # nothing listens there
    peer = await gateway.next_peer()
    register = await peer.register()
    assert register.models == []
    await peer.send(chat_request("d1", stream=True))
    chunks, complete = await peer.response("d1")
    assert chunks == []
    assert complete.status == 502
    assert complete.body is not None
    error = json.loads(complete.body)["error"]
    assert error["code"] == ERROR_BACKEND_UNAVAILABLE
    assert error["type"] == "server_error"


async def test_requests_over_capacity_are_refused(
    gateway: FakeGateway, start_worker: Any, backend: MockBackendProcess
) -> None:
    await _mock_post(backend, "/_mock/config", {"chunk_delay_ms": 300})
    start_worker(max_concurrency=1)
    peer = await gateway.next_peer()
    await peer.register()
    await peer.send(chat_request("a1", stream=True))
    await peer.expect(ResponseChunk)
    await peer.send(chat_request("a2", stream=True))
    while True:
        message = await peer.next()
        if isinstance(message, Error):
            break
    assert (message.request_id, message.code) == ("a2", ERROR_AT_CAPACITY)


async def test_models_refresh_relists_and_periodic_updates_only_on_change(
    gateway: FakeGateway, start_worker: Any, backend: MockBackendProcess
) -> None:
    start_worker(models_refresh_secs=0.1)
    peer = await gateway.next_peer()
    await peer.register()
    await peer.send(ModelsRefresh())
    asked = await peer.expect(ModelsUpdate)
    assert asked.models == ["llama3:8b", "mistral:7b"]
    await _mock_post(backend, "/_mock/config", {"models": ["phi3:mini"]})
    changed = await peer.expect(ModelsUpdate)
    assert changed.models == ["phi3:mini"]
    # Several more refresh periods pass without a change: nothing is sent.
    await asyncio.sleep(0.5)
    assert peer.inbox.empty()


async def test_reconnects_and_registers_again_after_the_gateway_drops_it(
    gateway: FakeGateway, start_worker: Any
) -> None:
    start_worker()
    first = await gateway.next_peer()
    await first.register()
    await first.ws.close(code=1011)
    second = await gateway.next_peer()
    register = await second.register()
    assert register.models == ["llama3:8b", "mistral:7b"]
    # The wait before reconnecting is the backoff's first step (0.2 s + jitter).
    assert gateway.attempts[1] - gateway.attempts[0] >= 0.2


async def test_a_silent_gateway_is_left_and_dialled_again(
    gateway: FakeGateway, start_worker: Any
) -> None:
    start_worker()
    first = await gateway.next_peer()
    await first.register(heartbeat_interval=0.05)
    second = await gateway.next_peer()  # no ping for 5 intervals: reconnect
    await second.register()
    assert first.closed.is_set()


async def test_a_gateway_that_stretches_its_interval_is_not_left(
    gateway: FakeGateway, start_worker: Any
) -> None:
    """A gateway with many workers pings less often than its register_ack
    said, and says so in its pings: the worker waits for them (5 of the
    stretched intervals) instead of dialling again after 5 of the ack's."""
    start_worker()
    peer = await gateway.next_peer()
    await peer.register(heartbeat_interval=0.05)
    await peer.send(Ping(timestamp=1.0, interval=0.4))
    await peer.expect(Pong)
    await asyncio.sleep(0.6)  # 12 of the ack's intervals, 1.5 of the ping's
    await peer.send(Ping(timestamp=2.0, interval=0.4))
    assert (await peer.expect(Pong)).timestamp == 2.0
    assert not peer.closed.is_set()
    # Silent for 5 of the stretched intervals: then it gives up.
    second = await gateway.next_peer()
    await second.register()
    assert peer.closed.is_set()


@pytest.mark.parametrize("refuse_with_403", [False, True])
async def test_a_rejected_secret_is_logged_and_retried_with_backoff(
    gateway: FakeGateway,
    start_worker: Any,
    caplog: pytest.LogCaptureFixture,
    refuse_with_403: bool,
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.worker")
    gateway.secret = "another-secret"
    gateway.refuse_with_403 = refuse_with_403
    start_worker()

    async def three_attempts() -> bool:
        return len(gateway.attempts) >= 3

    await _wait_for(three_attempts)
    first_gap = gateway.attempts[1] - gateway.attempts[0]
    second_gap = gateway.attempts[2] - gateway.attempts[1]
    assert first_gap >= 0.2
    assert second_gap >= 0.4  # doubled
    assert "secret rejected" in caplog.text
    assert SECRET not in caplog.text
    gateway.secret = SECRET  # the operator fixes it: the next attempt registers
    peer = await gateway.next_peer()
    await peer.register()


def test_backoff_doubles_up_to_its_limit_with_bounded_jitter() -> None:
    backoff = Backoff(first=1.0, limit=30.0, jitter=0.5)
    delays = [backoff.next_delay() for _ in range(8)]
    for delay, base in zip(delays, [1, 2, 4, 8, 16, 30, 30, 30], strict=True):
        assert base <= delay <= base + 0.5
    backoff.reset()
    assert backoff.next_delay() <= 1.5


async def _start_worker_process(
    gateway: FakeGateway, backend: MockBackendProcess, *args: str
) -> asyncio.subprocess.Process:
    env = {**os.environ, "NEXUS_WORKER_SECRET": SECRET}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "nexus_worker",
        "--server",
        gateway.url,
        "--backend",
        backend.base_url,
        "--name",
        "gpu-proc",
        *args,
        cwd=REPO_ROOT,
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_graceful_shutdown_finishes_in_flight_refuses_new_and_exits_0(
    gateway: FakeGateway, backend: MockBackendProcess
) -> None:
    await _mock_post(backend, "/_mock/config", {"chunk_delay_ms": 150})
    process = await _start_worker_process(gateway, backend)
    try:
        peer = await gateway.next_peer()
        await peer.register()
        await peer.send(chat_request("g1", stream=True))
        first = await peer.expect(ResponseChunk)
        await peer.send(GracefulShutdown(reason="maintenance", timeout_secs=30.0))
        assert (await peer.expect(Error)).code == ERROR_DRAINING
        await peer.send(chat_request("g2", stream=True))
        chunks: list[str] = [first.chunk]
        refused = None
        while True:
            message = await peer.next()
            if isinstance(message, Error):
                refused = message
            elif isinstance(message, ResponseChunk):
                chunks.append(message.chunk)
            else:
                assert isinstance(message, ResponseComplete)
                break
        assert refused is not None
        assert (refused.request_id, refused.code) == ("g2", ERROR_DRAINING)
        assert _content("".join(chunks)) == "[gpu/llama3:8b] echo: hi"
        assert await asyncio.wait_for(process.wait(), WAIT) == 0
        await asyncio.wait_for(peer.closed.wait(), WAIT)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_sigterm_drains_then_exits_0(
    gateway: FakeGateway, backend: MockBackendProcess
) -> None:
    await _mock_post(backend, "/_mock/config", {"chunk_delay_ms": 150})
    process = await _start_worker_process(gateway, backend)
    try:
        peer = await gateway.next_peer()
        await peer.register()
        await peer.send(chat_request("t1", stream=True))
        await peer.expect(ResponseChunk)
        process.send_signal(signal.SIGTERM)
        assert (await peer.expect(Error)).code == ERROR_DRAINING
        _, complete = await peer.response("t1")
        assert complete.status == 200
        assert await asyncio.wait_for(process.wait(), WAIT) == 0
        assert process.stderr is not None
        log = (await process.stderr.read()).decode()
        assert "draining (SIGTERM)" in log
        assert SECRET not in log
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_the_console_script_needs_a_secret_and_an_http_url() -> None:
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "NEXUS_WORKER_SECRET"}
    script = [sys.executable, "-m", "nexus_worker"]
    no_secret = subprocess.run(
        [*script, "--server", "http://g:8000"],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
    )
    assert no_secret.returncode == 2
    assert "NEXUS_WORKER_SECRET" in no_secret.stderr
    bad_url = subprocess.run(
        [*script, "--server", "gateway:8000"],
        env={**env, "NEXUS_WORKER_SECRET": "x"},
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
    )
    assert bad_url.returncode == 2
    assert "not an http(s) URL" in bad_url.stderr


@pytest.fixture
async def odd_backend() -> AsyncIterator[str]:
    """A local server whose answers the mock cannot give: split characters, big bodies.

    POST /v1/completions streams ``data: é`` with the two bytes of "é" in two
    writes; POST /v1/embeddings answers a plain body of 1.5 M characters; its
    GET /v1/models lists one model.
    """

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "odd"}]})

    async def split_character(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for piece in (b"data: \xc3", b"\xa9\n\n", b"data: [DONE]\n\n"):
            await response.write(piece)
            await asyncio.sleep(0.02)  # separate reads on the worker's side
        await response.write_eof()
        return response

    async def big(request: web.Request) -> web.Response:
        return web.json_response({"data": "x" * 1_500_000})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", split_character)
    app.router.add_post("/v1/embeddings", big)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


def _odd_request(request_id: str, endpoint: str, *, stream: bool) -> Request:
    return Request(
        request_id=request_id,
        model="odd",
        endpoint=endpoint,
        body="{}",
        is_streaming=stream,
    )


async def test_a_chunk_never_splits_a_utf8_character(
    gateway: FakeGateway, start_worker: Any, odd_backend: str
) -> None:
    start_worker(backend=odd_backend)
    peer = await gateway.next_peer()
    await peer.register()
    await peer.send(_odd_request("u1", "/v1/completions", stream=True))
    chunks, complete = await peer.response("u1")
    assert "".join(chunks) == "data: é\n\ndata: [DONE]\n\n"
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert complete.status == 200


async def test_a_body_too_big_for_one_frame_comes_as_chunks(
    gateway: FakeGateway, start_worker: Any, odd_backend: str
) -> None:
    start_worker(backend=odd_backend)
    peer = await gateway.next_peer()
    await peer.register()
    await peer.send(_odd_request("b1", "/v1/embeddings", stream=False))
    chunks, complete = await peer.response("b1")
    body = json.dumps({"data": "x" * 1_500_000})
    assert len(chunks) == -(-len(body) // MAX_CHUNK_CHARS)  # full pieces, one rest
    assert json.loads("".join(chunks)) == {"data": "x" * 1_500_000}
    assert (complete.status, complete.body) == (200, None)


async def test_a_response_over_the_size_limit_is_cut_with_an_error(
    gateway: FakeGateway,
    start_worker: Any,
    odd_backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("nexus_worker.forwarding.MAX_RESPONSE_BYTES", 10)
    start_worker(backend=odd_backend)
    peer = await gateway.next_peer()
    await peer.register()
    await peer.send(_odd_request("z1", "/v1/completions", stream=True))
    message = await peer.next()
    while isinstance(message, ResponseChunk):
        message = await peer.next()
    assert isinstance(message, Error)
    assert (message.request_id, message.code) == ("z1", ERROR_RESPONSE_TOO_LARGE)
    await peer.send(_odd_request("z2", "/v1/embeddings", stream=False))
    _, complete = await peer.response("z2")
    assert complete.status == 502
    assert complete.body is not None
    assert json.loads(complete.body)["error"]["code"] == ERROR_RESPONSE_TOO_LARGE


async def test_a_malformed_request_fails_by_its_id_and_the_socket_stays_up(
    gateway: FakeGateway, start_worker: Any
) -> None:
    start_worker()
    peer = await gateway.next_peer()
    await peer.register()
    frame = {
        "type": "request",
        "request_id": "m1",
        "model": "llama3:8b",
        "endpoint": "/v1/chat/completions",
        "body": 7,
    }
    await peer.ws.send_str(json.dumps(frame))
    error = await peer.expect(Error)
    assert (error.request_id, error.code) == ("m1", "bad_message")
    assert "request.body: not a string" in error.message
    await peer.ws.send_str('{"type": "gossip"}')  # unknown: ignored
    await peer.send(Ping(timestamp=4.0))
    assert _heard(await peer.expect(Pong)) == (4.0, 0)


async def test_a_repeated_graceful_shutdown_does_not_cut_requests_in_flight(
    gateway: FakeGateway, start_worker: Any, backend: MockBackendProcess
) -> None:
    await _mock_post(backend, "/_mock/config", {"chunk_delay_ms": 100})
    worker = start_worker()
    peer = await gateway.next_peer()
    await peer.register()
    await peer.send(chat_request("h1", stream=True))
    chunks = [(await peer.expect(ResponseChunk)).chunk]
    await peer.send(GracefulShutdown(timeout_secs=30.0))
    await peer.send(GracefulShutdown(timeout_secs=30.0))
    assert (await peer.expect(Error)).code == ERROR_DRAINING
    rest, complete = await peer.response("h1")
    assert _content("".join(chunks + rest)) == "[gpu/llama3:8b] echo: hi"
    assert complete.status == 200
    await asyncio.wait_for(peer.closed.wait(), WAIT)
    assert worker.draining


async def test_a_second_sigterm_stops_at_once(
    gateway: FakeGateway, backend: MockBackendProcess
) -> None:
    await _mock_post(backend, "/_mock/config", {"chunks": 100, "chunk_delay_ms": 200})
    process = await _start_worker_process(gateway, backend)
    try:
        peer = await gateway.next_peer()
        await peer.register()
        await peer.send(chat_request("q1", stream=True))
        await peer.expect(ResponseChunk)
        process.send_signal(signal.SIGTERM)
        assert (await peer.expect(Error)).code == ERROR_DRAINING
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), WAIT) == 0
        await asyncio.wait_for(peer.closed.wait(), WAIT)
        while not peer.inbox.empty():  # a chunk or two, never the end
            assert isinstance(peer.inbox.get_nowait(), ResponseChunk)

        async def backend_saw_the_disconnect() -> bool:
            return (await _mock_stats(backend))["client_disconnects"] == 1

        await _wait_for(backend_saw_the_disconnect)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_llamacpp_backend_reports_its_slots_and_every_model_loaded(
    gateway: FakeGateway, start_worker: Any
) -> None:
    """llama.cpp's /slots (a list, each slot busy or not): the worker says how
    many there are and are busy, and that the model it serves is loaded."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "qwen"}]})

    async def slots(request: web.Request) -> web.Response:
        busy = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}]
        return web.json_response(busy + [{"id": 2, "is_processing": False}])

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/slots", slots)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        start_worker(backend=f"http://127.0.0.1:{port}", backend_kind="openai")
        peer = await gateway.next_peer()
        register = await peer.register()
        assert register.state is not None
        assert (register.state.slots, register.state.busy_slots) == (3, 1)
        assert register.state.loaded is not None
        assert [model.name for model in register.state.loaded] == ["qwen"]
    finally:
        await runner.cleanup()
