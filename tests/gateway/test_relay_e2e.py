"""Workers behind NAT, end to end: real Daphne, the real nexus-worker, the mock
backend as each worker's local model server, the official openai SDK as client.

The seed's contract list (worker-relay-architecture.txt): registration and a bad
secret, revocation of a live worker, non-stream and stream requests with their
order and termination, client cancel reaching the local backend, a worker
killed mid-request (requeue before the first byte, error event after), the
heartbeat timeout, model refresh, graceful drain, usage counted exactly, and
(production mode) a worker connected to one serving process serving requests
that arrive at another.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp
import httpx
import openai
import pytest
from django.conf import settings
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus, Worker
from nexus_worker import protocol
from routing.models import RoutingPolicy
from routing.versioning import read_config_version
from tests.conftest import MockBackendProcess, NexusServer, mock_stats, wait_until
from tests.factories import StaffUserFactory
from tests.gateway.relay_workers import WorkerProcess, start_worker
from usage.models import ApiKey, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "llama3:8b"
HEARTBEAT = "1.0"  # seconds: Gone after 3 missed (a loaded machine starves workers)
# Liveness reaches the database every heartbeat here (30 s by default).
RELAY_ENV = {
    "NEXUS_RELAY_HEARTBEAT_SECONDS": HEARTBEAT,
    "NEXUS_RELAY_SEEN_WRITE_SECONDS": HEARTBEAT,
}
wait_for = functools.partial(wait_until, timeout=15.0)


@pytest.fixture
def worker_factory() -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(
        server: NexusServer, secret: str, mock: MockBackendProcess, *args: str
    ) -> WorkerProcess:
        worker = start_worker(server, mock, secret, "--backend-kind", "openai", *args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


def _server_version(server: NexusServer) -> int:
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("nexus_config_version "):
            return int(float(line.split()[1]))
    return -1


def wait_until_live(*servers: NexusServer) -> None:
    """Wait until every server routes with the database's configuration."""
    version = read_config_version()
    for server in servers:
        wait_for(lambda server=server: _server_version(server) >= version)


def wait_routable(server: NexusServer, backend: str, model: str = MODEL) -> None:
    """Wait until `server` routes `model` to `backend` (its snapshot has both)."""
    headers = _staff_headers()

    def routable() -> bool:
        answer = httpx.post(
            f"{server.base_url}/api/v1/route/explain",
            json={"model": model},
            headers=headers,
            timeout=5,
        )
        candidates = answer.json().get("candidates") or []
        return any(c.get("backend") == backend for c in candidates)

    wait_for(routable)


def wait_registered(name: str) -> Worker:
    def registered() -> bool:
        worker = Worker.objects.filter(name=name).select_related("backend").first()
        return bool(
            worker
            and worker.channel_name
            and worker.backend
            and worker.backend.status == HealthStatus.HEALTHY
        )

    wait_for(registered)
    return Worker.objects.select_related("backend").get(name=name)


def _sdk(server: NexusServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=30
    )


def _staff_headers() -> dict[str, str]:
    token = Token.objects.create(user=StaffUserFactory())
    return {"Authorization": f"Token {token.key}"}


def _usage_rows(backend: str) -> list[UsageRecord]:
    if settings.NEXUS_USAGE_TRANSPORT == "redis":
        drain_usage_stream()
    return list(UsageRecord.objects.filter(backend=backend))


@dataclass
class Relay:
    """A serving process, a client key, and a starter of registered workers."""

    server: NexusServer
    key: str
    start: Callable[..., tuple[MockBackendProcess, WorkerProcess]]


@pytest.fixture
def relay(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
    worker_factory: Callable[..., WorkerProcess],
) -> Relay:
    """Start a server; a worker's name names its mock, secret and backend."""
    if settings.NEXUS_USAGE_TRANSPORT == "redis":
        clear_usage_stream()
    server = nexus_server_factory(**RELAY_ENV)
    _, key = ApiKey.objects.create_key("relay-tests")

    def start(
        name: str,
        *mock_args: str,
        at: NexusServer = server,
        worker_args: tuple[str, ...] = (),
    ) -> tuple[MockBackendProcess, WorkerProcess]:
        mock = mock_backend_factory("--models", MODEL, "--name", name, *mock_args)
        _, secret = Worker.objects.create_worker(name)
        worker = worker_factory(at, secret, mock, "--name", name, *worker_args)
        wait_registered(name)
        wait_until_live(at)
        wait_routable(at, name)
        return mock, worker

    return Relay(server, key, start)


def test_worker_serves_chat_stream_and_not_with_exact_usage(relay: Relay) -> None:
    server, key, start = relay.server, relay.key, relay.start
    start("gpu-a", "--chunks", "6")
    sdk = _sdk(server, key)

    assert [m.id for m in sdk.models.list().data] == [MODEL]
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello relay"}]
    )
    reply = raw.parse()
    assert raw.headers["x-nexus-backend"] == "gpu-a"
    assert reply.choices[0].message.content == "[gpu-a/llama3:8b] echo: hello relay"

    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "one two three four five"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    # In order and whole: the chunks join to the backend's exact text.
    assert "".join(pieces) == "[gpu-a/llama3:8b] echo: one two three four five"
    assert len([p for p in pieces if p]) == 6
    assert finish == "stop"
    assert usage is not None

    wait_for(lambda: len(_usage_rows("gpu-a")) == 2)
    rows = sorted(_usage_rows("gpu-a"), key=lambda row: row.streamed)
    assert [row.total_tokens for row in rows] == [
        reply.usage.total_tokens,
        usage.total_tokens,
    ]
    assert [row.completion_tokens for row in rows] == [
        reply.usage.completion_tokens,
        usage.completion_tokens,
    ]


def test_anthropic_client_is_served_through_a_worker(relay: Relay) -> None:
    server, key, start = relay.server, relay.key, relay.start
    start("gpu-a")
    answer = httpx.post(
        f"{server.base_url}/v1/messages",
        headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        json={
            "model": MODEL,
            "max_tokens": 50,
            "messages": [{"role": "user", "content": "hi"}],
        },
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"][0]["text"] == "[gpu-a/llama3:8b] echo: hi"


async def _close_code(server: NexusServer, headers: dict[str, str], first: str) -> int:
    url = server.base_url.replace("http", "ws") + protocol.WEBSOCKET_PATH
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(url, headers=headers) as ws,
    ):
        if first:
            await ws.send_str(first)
        async with asyncio.timeout(10):
            async for _ in ws:
                pass
        return int(ws.close_code or 0)


def test_bad_secret_and_unsupported_version_are_closed(
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    server = nexus_server_factory()
    _, secret = Worker.objects.create_worker("gpu-v")
    bad = {protocol.SECRET_HEADER: "nxw-not-the-secret"}
    assert asyncio.run(_close_code(server, bad, "")) == 4001
    assert asyncio.run(_close_code(server, {}, "")) == 4001
    newer = (
        '{"type":"register","name":"gpu-v","models":["m"],"max_concurrency":1,'
        '"load":0,"protocol_version":2}'
    )
    good = {protocol.SECRET_HEADER: secret}
    assert asyncio.run(_close_code(server, good, newer)) == 4002
    assert Worker.objects.get(name="gpu-v").channel_name == ""


def test_unknown_and_malformed_frames_leave_the_worker_serving(
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    server = nexus_server_factory()
    _, secret = Worker.objects.create_worker("gpu-u")

    def has_models() -> bool:
        served = BackendModel.objects.filter(backend__name="gpu-u", enabled=True)
        return set(served.values_list("name", flat=True)) == {"m", "n"}

    async def session() -> str:
        url = server.base_url.replace("http", "ws") + protocol.WEBSOCKET_PATH
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(url, headers={protocol.SECRET_HEADER: secret}) as ws,
        ):
            await ws.send_str(
                '{"type":"register","name":"x","models":["m"],'
                '"max_concurrency":1,"load":0,"protocol_version":1}'
            )
            ack = await ws.receive_json(timeout=10)
            for junk in ('{"type":"from_the_future"}', "not json", "[1]"):
                await ws.send_str(junk)
            await ws.send_str('{"type":"models_update","models":["m","n"],"load":0}')
            # The consumer survived the junk: it applies the update after it.
            await asyncio.to_thread(wait_for, has_models)
            return str(ack["type"])

    assert asyncio.run(session()) == "register_ack"


async def _answer_pings(ws: aiohttp.ClientWebSocketResponse) -> None:
    async for frame in ws:
        if '"ping"' in frame.data:
            await ws.send_str('{"type":"pong","load":0}')


def test_a_frame_nested_100000_deep_leaves_no_ghost_worker(
    relay: Relay, nexus_server_factory: Callable[..., NexusServer]
) -> None:
    """Red team (issue 27, item 3): the decoder's RecursionError killed the
    consumer; its disconnect never ran, the worker stayed "healthy" for 30 s
    and requests for its model hung or failed after 15-300 s. Now its socket
    alone is closed, the worker is Gone at once, its model served elsewhere."""
    relay.start("gpu-b")
    servers = [relay.server]
    if settings.REDIS_URL:  # the worker's process and another one
        servers.append(nexus_server_factory(**RELAY_ENV))
    _, secret = Worker.objects.create_worker("gpu-a")
    deep = '{"type":"pong","load":0,"x":' + "[" * 100_000 + "]" * 100_000 + "}"

    async def hostile() -> int:
        url = relay.server.base_url.replace("http", "ws") + protocol.WEBSOCKET_PATH
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(url, headers={protocol.SECRET_HEADER: secret}) as ws,
        ):
            register = protocol.Register(
                name="gpu-a", models=[MODEL], max_concurrency=4
            )
            await ws.send_str(protocol.encode(register))
            answering = asyncio.create_task(_answer_pings(ws))
            await asyncio.to_thread(wait_registered, "gpu-a")
            for server in servers:
                await asyncio.to_thread(wait_until_live, server)
                await asyncio.to_thread(wait_routable, server, "gpu-a")
            answering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await answering
            await ws.send_str(deep)
            async with asyncio.timeout(10):
                async for _ in ws:
                    pass
            return int(ws.close_code or 0)

    assert asyncio.run(hostile()) == protocol.CloseCode.BAD_FRAME
    # Gone at once (its heartbeats would have taken 3 s, the sweep 30 s).
    wait_for(lambda: Worker.objects.get(name="gpu-a").channel_name == "", timeout=5)
    assert Backend.objects.get(name="gpu-a").status == HealthStatus.UNHEALTHY
    for server in servers:
        for n in range(4):
            started = time.monotonic()
            raw = openai.OpenAI(
                base_url=f"{server.base_url}/v1",
                api_key=relay.key,
                max_retries=0,
                timeout=10,
            ).chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"after {n}"}]
            )
            assert raw.headers["x-nexus-backend"] == "gpu-b"
            assert time.monotonic() - started < 5


def test_revoking_a_worker_disconnects_it(relay: Relay) -> None:
    server, key, start = relay.server, relay.key, relay.start
    _, worker = start("gpu-a")
    row = Worker.objects.get(name="gpu-a")
    answer = httpx.post(
        f"{server.base_url}/api/v1/workers/{row.pk}/revoke",
        headers=_staff_headers(),
        timeout=10,
    )
    assert answer.status_code == 200
    assert answer.json()["is_active"] is False
    wait_for(lambda: worker.logged("secret rejected"), timeout=5)
    wait_for(lambda: Worker.objects.get(name="gpu-a").channel_name == "")
    assert Backend.objects.get(name="gpu-a").status == HealthStatus.UNHEALTHY
    wait_until_live(server)
    with pytest.raises(openai.APIStatusError) as refused:
        _sdk(server, key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.status_code == 503


def test_client_cancel_reaches_the_local_backend(relay: Relay) -> None:
    server, key, start = relay.server, relay.key, relay.start
    mock, _ = start("gpu-a", "--chunks", "50", "--chunk-delay-ms", "200")
    stream = _sdk(server, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "long"}], stream=True
    )
    next(iter(stream))
    stream.close()
    stats = lambda: httpx.get(f"{mock.base_url}/_mock/stats", timeout=5).json()
    wait_for(lambda: stats()["client_disconnects"] == 1, timeout=5)
    assert stats()["in_flight"] == 0


def _in_flight(mock: MockBackendProcess) -> int:
    return int(mock_stats(mock)["in_flight"])


def _chats(mock: MockBackendProcess) -> int:
    """Chat requests the mock has seen (in flight or done)."""
    return int(mock_stats(mock)["requests"].get("/v1/chat/completions", 0))


def test_worker_killed_before_the_first_byte_is_requeued(relay: Relay) -> None:
    server, key, start = relay.server, relay.key, relay.start
    mock_a, worker_a = start("gpu-a", "--latency-ms", "1500")
    mock_b, worker_b = start("gpu-b", "--latency-ms", "1500")
    result: list[object] = []

    def ask() -> None:
        try:
            result.append(
                _sdk(server, key).chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "again"}]
                )
            )
        except Exception as error:  # noqa: BLE001 - reported below
            result.append(error)

    thread = threading.Thread(target=ask)
    thread.start()
    # Counted once seen, in flight or not: a starved test cannot miss it.
    wait_for(lambda: _chats(mock_a) + _chats(mock_b) == 1)
    first, other = ("gpu-a", "gpu-b") if _chats(mock_a) else ("gpu-b", "gpu-a")
    (worker_a if first == "gpu-a" else worker_b).process.send_signal(signal.SIGKILL)
    thread.join(timeout=30)
    raw = result[0]
    assert not isinstance(raw, Exception), raw
    assert raw.headers["x-nexus-backend"] == other  # type: ignore[attr-defined]
    text = raw.parse().choices[0].message.content  # type: ignore[attr-defined]
    assert text == f"[{other}/llama3:8b] echo: again"
    wait_for(lambda: len(_usage_rows(other)) == 1)
    assert _usage_rows(first) == []


def _seen_at(name: str) -> object:
    return Worker.objects.get(name=name).last_seen_at


def test_a_serving_process_that_stalls_keeps_its_workers(relay: Relay) -> None:
    """A gateway that sent no pings (stopped, starved) has no worker Gone.

    The process is stopped for 3.5 heartbeats, from just after a ping: its
    workers answered every ping it sent, so they stay (a worker gives up on
    a silent gateway only after 5 heartbeats).
    """
    server, key, start = relay.server, relay.key, relay.start
    start("gpu-a")
    channel = Worker.objects.get(name="gpu-a").channel_name
    seen = _seen_at("gpu-a")
    wait_for(lambda: _seen_at("gpu-a") != seen)  # a ping just went out
    server.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3.5 * float(HEARTBEAT))  # the stall itself, not a wait
    finally:
        server.process.send_signal(signal.SIGCONT)
    resumed = _seen_at("gpu-a")
    # A heartbeat after the stall went by (the first one is where a gateway
    # that counted time rather than pings gave its worker up).
    wait_for(lambda: _seen_at("gpu-a") != resumed)
    assert not any("missed" in line for line in server.log)
    assert Worker.objects.get(name="gpu-a").channel_name == channel
    assert Backend.objects.get(name="gpu-a").status == HealthStatus.HEALTHY
    reply = _sdk(server, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "still here"}]
    )
    assert reply.choices[0].message.content == "[gpu-a/llama3:8b] echo: still here"


def test_worker_killed_mid_stream_ends_it_with_an_error_event(relay: Relay) -> None:
    server, key, start = relay.server, relay.key, relay.start
    _, worker = start("gpu-a", "--chunks", "50", "--chunk-delay-ms", "100")
    stream = _sdk(server, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "long"}], stream=True
    )
    chunks = iter(stream)
    assert next(chunks).choices  # the stream started: its head went out
    worker.process.send_signal(signal.SIGKILL)
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for _ in chunks:
            pass


def test_sigterm_just_after_a_worker_left_stops_the_serving_process(
    relay: Relay,
) -> None:
    """The serving process's database work for the closed socket must not hold
    up its exit: it used to wait for ever on the stopped event loop to
    broadcast the configuration change, until killed."""
    _, worker = relay.start("gpu-a")
    worker.kill()
    relay.server.process.terminate()
    assert relay.server.process.wait(timeout=8) == 0


def test_a_silent_worker_is_gone_after_three_heartbeats(relay: Relay) -> None:
    _, worker = relay.start("gpu-a")
    worker.process.send_signal(signal.SIGSTOP)
    try:
        wait_for(
            lambda: Backend.objects.get(name="gpu-a").status == HealthStatus.UNHEALTHY,
            timeout=10,
        )
        assert Worker.objects.get(name="gpu-a").channel_name == ""
    finally:
        worker.process.send_signal(signal.SIGCONT)
    # It reconnects on its own and serves again.
    wait_registered("gpu-a")


def test_models_refresh_reaches_the_backend_models(relay: Relay) -> None:
    server, key, start = relay.server, relay.key, relay.start
    mock, _ = start("gpu-a")
    httpx.post(
        f"{mock.base_url}/_mock/config",
        json={"models": [MODEL, "qwen:1b"]},
        timeout=5,
    )
    row = Worker.objects.get(name="gpu-a")
    answer = httpx.post(
        f"{server.base_url}/api/v1/workers/{row.pk}/refresh",
        headers=_staff_headers(),
        timeout=10,
    )
    assert answer.status_code == 200
    wait_for(
        lambda: (
            set(
                BackendModel.objects.filter(
                    backend__name="gpu-a", enabled=True
                ).values_list("name", flat=True)
            )
            == {MODEL, "qwen:1b"}
        )
    )
    wait_until_live(server)
    wait_routable(server, "gpu-a", "qwen:1b")
    reply = _sdk(server, key).chat.completions.create(
        model="qwen:1b", messages=[{"role": "user", "content": "new"}]
    )
    assert reply.choices[0].message.content == "[gpu-a/qwen:1b] echo: new"


@pytest.mark.parametrize("how", ["admin API", "SIGTERM on the worker"])
def test_drain_finishes_the_stream_in_flight_and_the_worker_exits_0(
    relay: Relay, how: str
) -> None:
    server, key, start = relay.server, relay.key, relay.start
    _, worker = start("gpu-a", "--chunks", "20", "--chunk-delay-ms", "100")
    stream = _sdk(server, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "drain me"}], stream=True
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].delta.content or ""
    if how == "SIGTERM on the worker":
        worker.process.send_signal(signal.SIGTERM)
        wait_for(
            lambda: Backend.objects.get(name="gpu-a").status == HealthStatus.DRAINING
        )
    else:
        row = Worker.objects.get(name="gpu-a")
        answer = httpx.post(
            f"{server.base_url}/api/v1/workers/{row.pk}/drain",
            headers=_staff_headers(),
            json={"timeout": 30},
            timeout=10,
        )
        assert answer.status_code == 200
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text == "[gpu-a/llama3:8b] echo: drain me"
    assert worker.process.wait(timeout=20) == 0
    wait_for(lambda: Backend.objects.get(name="gpu-a").status != HealthStatus.HEALTHY)


@pytest.mark.skipif(not settings.REDIS_URL, reason="production mode (Redis layer)")
def test_worker_on_one_serving_process_serves_requests_at_another(
    relay: Relay,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    mock, _ = relay.start("gpu-a", "--chunks", "8")
    other = nexus_server_factory(**RELAY_ENV)
    wait_until_live(other)
    sdk = _sdk(other, relay.key)
    reply = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "across"}]
    )
    assert reply.choices[0].message.content == "[gpu-a/llama3:8b] echo: across"
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a b c d e f g h"}],
        stream=True,
    )
    text = "".join(
        chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
    )
    assert text == "[gpu-a/llama3:8b] echo: a b c d e f g h"
    wait_for(lambda: len(_usage_rows("gpu-a")) == 2)

    # A client leaving at the other process cancels at the worker too.
    httpx.post(
        f"{mock.base_url}/_mock/config",
        json={"chunks": 50, "chunk_delay_ms": 200},
        timeout=5,
    )
    stream = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "long"}], stream=True
    )
    next(iter(stream))
    stream.close()
    stats = lambda: httpx.get(f"{mock.base_url}/_mock/stats", timeout=5).json()
    wait_for(lambda: stats()["client_disconnects"] == 1, timeout=5)


def _explained_in_flight(server: NexusServer, backend: str) -> int:
    answer = httpx.post(
        f"{server.base_url}/api/v1/route/explain",
        json={"model": MODEL},
        headers=_staff_headers(),
        timeout=5,
    )
    for candidate in answer.json().get("candidates") or []:
        if candidate.get("backend") == backend:
            return int(candidate.get("in_flight") or 0)
    return -1


@pytest.mark.skipif(not settings.REDIS_URL, reason="production mode (Redis layer)")
def test_every_serving_process_routes_by_the_load_workers_report(
    relay: Relay,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    """A worker busy with one process's requests is avoided by another that
    has none in flight there: the worker's pongs reach every process."""
    mock_a, _ = relay.start("gpu-a", "--latency-ms", "5000")
    mock_b, _ = relay.start("gpu-b")
    other = nexus_server_factory(**RELAY_ENV)
    wait_until_live(other)
    wait_routable(other, "gpu-b")
    sdk = _sdk(relay.server, relay.key)
    slow = threading.Thread(
        target=lambda: sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "slow"}]
        )
    )
    slow.start()
    # Equal workers: the tie goes to the first, gpu-a (the slow one).
    wait_for(lambda: _chats(mock_a) == 1)
    # The other process sent nothing there, yet counts gpu-a's request.
    wait_for(lambda: _explained_in_flight(other, "gpu-a") == 1)
    raw = _sdk(other, relay.key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "quick"}]
    )
    assert raw.headers["x-nexus-backend"] == "gpu-b"
    slow.join(timeout=30)
    assert _chats(mock_b) == 1


@pytest.mark.skipif(not settings.REDIS_URL, reason="production mode (Redis layer)")
def test_workers_of_a_killed_serving_process_are_gone_everywhere_soon(
    relay: Relay,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    relay.start("gpu-a")
    other = nexus_server_factory(**RELAY_ENV)
    wait_until_live(other)
    wait_routable(other, "gpu-a")
    relay.server.process.send_signal(signal.SIGKILL)  # it tells no one
    # Not seen for 3 heartbeats (10 s at least): the other process makes it
    # Gone (without it, its row would say healthy until the worker came back,
    # and its health result would count for 30 s).
    wait_for(
        lambda: Backend.objects.get(name="gpu-a").status == HealthStatus.UNHEALTHY,
        timeout=25,
    )
    assert Worker.objects.get(name="gpu-a").channel_name == ""
    wait_for(lambda: any("serving process went silent" in line for line in other.log))
    wait_until_live(other)
    with pytest.raises(openai.APIStatusError) as refused:
        _sdk(other, relay.key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "anyone?"}]
        )
    assert refused.value.status_code == 503


def test_busy_workers_wait_in_admissions_queue_which_is_bounded(
    relay: Relay,
) -> None:
    # Admission control is on by default; its band for the worker's pool is
    # the worker's max_concurrency (1), its queue holds one request.
    policy = RoutingPolicy.load()
    assert policy.admission_enabled
    policy.admission_total_capacity = 1
    policy.admission_flow_capacity = 1
    policy.admission_critical_reserved = 0
    policy.save()
    _, other_key = ApiKey.objects.create_key("relay-tests-other")
    server = relay.server
    mock, _ = relay.start(  # it waits until the server has the above
        "gpu-a", "--slots", "4", worker_args=("--max-concurrency", "1")
    )
    # The first request waits at the mock until released, so that the third
    # finds it still running however slowly a loaded machine sends them (a
    # 3 s answer once ended first).
    httpx.post(f"{mock.base_url}/_mock/hold", json={"first": 2}, timeout=10)
    results: dict[str, object] = {}

    def ask(label: str, key: str = relay.key) -> None:
        try:
            reply = _sdk(server, key).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": label}]
            )
            results[label] = reply.choices[0].message.content
        except openai.APIStatusError as error:
            results[label] = (
                error.status_code,
                error.type,
                error.code,
                error.response.headers.get("retry-after"),
            )

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    wait_for(lambda: _chats(mock) == 1)  # held at the mock
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    # The worker is busy: the second request waits in admission's queue, not
    # at the worker (which would refuse it) and not in a line of the relay's.
    wait_for(lambda: server.metric("nexus_admission_queue_length") == 1)
    assert _chats(mock) == 1
    ask("third", other_key)  # another flow: the queue itself is full
    httpx.post(f"{mock.base_url}/_mock/release", timeout=10)
    first.join(timeout=30)
    second.join(timeout=30)
    assert results == {
        "first": "[gpu-a/llama3:8b] echo: first",
        "second": "[gpu-a/llama3:8b] echo: second",  # served when the slot freed
        "third": (503, "server_error", "queue_full", "1"),
    }
    assert _chats(mock) == 2
    assert server.metric("nexus_admission_queue_length") == 0

    # A request that waits past the queue's TTL gets its 503 there too.
    policy.admission_queue_ttl = 1.0
    policy.save()
    wait_until_live(server)
    httpx.post(f"{mock.base_url}/_mock/hold", json={"first": 2}, timeout=10)
    slow = threading.Thread(target=ask, args=("slow",))
    slow.start()
    wait_for(lambda: _chats(mock) == 3)  # held at the mock
    ask("late")
    assert results["late"] == (503, "server_error", "queue_ttl_expired", "1")
    httpx.post(f"{mock.base_url}/_mock/release", timeout=10)
    slow.join(timeout=30)
    assert results["slow"] == "[gpu-a/llama3:8b] echo: slow"
    assert _chats(mock) == 3  # the late request never reached the worker


def test_a_worker_that_registers_takes_the_requests_already_waiting(
    relay: Relay,
) -> None:
    # Issue 30: the admission pool used to be keyed by the ready backends, so
    # requests queued for gpu-a stayed there when gpu-b registered.
    server = relay.server
    mock_a, _ = relay.start(
        "gpu-a", "--slots", "4", worker_args=("--max-concurrency", "1")
    )
    httpx.post(f"{mock_a.base_url}/_mock/hold", json={"first": 100}, timeout=10)
    results: dict[str, object] = {}

    def ask(label: str) -> None:
        try:
            reply = _sdk(server, relay.key).chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": label}]
            )
        except openai.APIError as error:  # shown by the assertion below
            results[label] = repr(error)
        else:
            results[label] = reply.headers["x-nexus-backend"]

    asking = [threading.Thread(target=ask, args=(f"r{n}",)) for n in range(3)]
    for thread in asking:
        thread.start()
    wait_for(lambda: _chats(mock_a) == 1)  # held at gpu-a's mock
    wait_for(lambda: server.metric("nexus_admission_queue_length") == 2)
    mock_b, _ = relay.start(
        "gpu-b", "--slots", "4", worker_args=("--max-concurrency", "1")
    )
    # The two waiting go to the new worker while gpu-a still holds its one.
    wait_for(lambda: _chats(mock_b) == 2 or len(results) == 2)
    assert _chats(mock_b) == 2, results
    assert _chats(mock_a) == 1
    httpx.post(f"{mock_a.base_url}/_mock/release", timeout=10)
    for thread in asking:
        thread.join(timeout=30)
    assert sorted(results.values()) == ["gpu-a", "gpu-b", "gpu-b"]


def test_under_fleet_a_busy_workers_requests_wait_in_its_line(relay: Relay) -> None:
    policy = RoutingPolicy.load()
    policy.strategy = "fleet"
    policy.full_clean()
    policy.save()
    mock, _ = relay.start(
        "gpu-a", "--slots", "4", worker_args=("--max-concurrency", "1")
    )
    # The first request waits at the mock until released (it never sees a
    # second: the worker takes one at a time), however long a loaded machine
    # takes to queue the second one.
    httpx.post(f"{mock.base_url}/_mock/hold", json={"first": 2}, timeout=10)
    results: dict[str, object] = {}

    def ask(label: str) -> None:
        reply = _sdk(relay.server, relay.key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": label}]
        )
        results[label] = reply.choices[0].message.content

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    wait_for(lambda: _chats(mock) == 1)  # held at the mock
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    # Admission lets it through to the worker's line, where it waits.
    wait_for(
        lambda: relay.server.metric("nexus_fleet_queue_waiting", 'backend="gpu-a"') == 1
    )
    assert _chats(mock) == 1
    httpx.post(f"{mock.base_url}/_mock/release", timeout=10)
    first.join(timeout=30)
    second.join(timeout=30)
    assert results == {
        "first": "[gpu-a/llama3:8b] echo: first",
        "second": "[gpu-a/llama3:8b] echo: second",
    }
    assert _chats(mock) == 2


def test_with_admission_off_a_busy_worker_is_refused_like_any_full_backend(
    relay: Relay,
) -> None:
    # Off, admission's queue is gone for every backend, a worker's included.
    policy = RoutingPolicy.load()
    policy.admission_enabled = False
    policy.save()
    mock, _ = relay.start(
        "gpu-a", "--latency-ms", "1000", worker_args=("--max-concurrency", "1")
    )
    sdk = _sdk(relay.server, relay.key)
    first = threading.Thread(
        target=sdk.chat.completions.create,
        kwargs={"model": MODEL, "messages": [{"role": "user", "content": "first"}]},
    )
    first.start()
    wait_for(lambda: _in_flight(mock) == 1)
    with pytest.raises(openai.APIStatusError) as refused:
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "second"}]
        )
    first.join(timeout=30)
    # The router's answer for any backend at its max_concurrency: no line of
    # the relay's own, and nothing sent to the worker (which would refuse it).
    assert refused.value.status_code == 503
    assert refused.value.code == "no_healthy_backend"
    assert "1 at max concurrency" in refused.value.message
    assert _chats(mock) == 1
