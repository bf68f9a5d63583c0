"""The error cache: a backend that refused a connection is skipped for a while.

Unit parts with a hand-driven clock (what counts as a connection failure, the
router's skip and its last-resort exception, the once-a-minute log), then real
processes: a mock backend killed under a serving Nexus, watched through the
port it listened on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import aiohttp
import httpx
import openai
import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from gateway.error_cache import ErrorCache, FailureLog, is_connection_failure
from nexus_mock import MockBackendProcess
from routing.core import (
    BackendSpec,
    LiveStats,
    ModelSpec,
    Reason,
    RequestRequirements,
    Router,
    RouterSnapshot,
)
from routing.models import RoutingPolicy
from tests.backends.mock_fleet import closed_port_url
from tests.conftest import NexusServer, mock_stats, start_mock_backend, wait_until
from usage.models import ApiKey

CACHE_SECONDS = 10.0
REQUEST = RequestRequirements(model="llama3:8b")


class Clock:
    """A hand-driven monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _refused() -> aiohttp.ClientError:
    """The error aiohttp raises for a port where nothing listens."""
    async with aiohttp.ClientSession() as session:
        try:
            await session.post(closed_port_url() + "/v1/chat/completions")
        except aiohttp.ClientError as error:
            return error
    raise AssertionError("a closed port accepted a connection")


@pytest.fixture(scope="module")
def refused() -> aiohttp.ClientError:
    """A real refused connection's error (the tests below run off the event
    loop, so that nothing is announced on the channel layer)."""
    return asyncio.run(_refused())


def _make_cache(
    clock: Clock, seconds: float = CACHE_SECONDS
) -> tuple[ErrorCache, LiveStats]:
    stats = LiveStats(clock=clock)
    return ErrorCache(stats=stats, seconds=seconds), stats


def _snapshot(*names: str) -> RouterSnapshot:
    model = ModelSpec(name="llama3:8b")
    return RouterSnapshot.build(
        backends=[
            BackendSpec(
                name=name,
                base_url=f"http://{name}:8000",
                priority=priority,
                status="healthy",
                models=(model,),
            )
            for priority, name in enumerate(names, start=1)
        ]
    )


def test_only_a_failure_to_reach_the_server_counts(
    refused: aiohttp.ClientError,
) -> None:
    assert is_connection_failure(refused)
    # A live server's doing: it hung up after answering, or answered slowly.
    assert not is_connection_failure(aiohttp.ServerDisconnectedError())
    assert not is_connection_failure(TimeoutError())
    assert not is_connection_failure(aiohttp.ClientPayloadError("cut short"))


def test_a_refused_connection_skips_the_backend_until_the_time_is_up(
    refused: aiohttp.ClientError,
) -> None:
    clock = Clock()
    cache, stats = _make_cache(clock)
    snapshot = _snapshot("gpu-1", "gpu-2")
    assert Router().select(REQUEST, snapshot, stats).target.backend_name == "gpu-1"

    assert cache.connect_failed("gpu-1", refused)
    route = Router().select(REQUEST, snapshot, stats)
    assert route.target.backend_name == "gpu-2"
    assert route.retry_targets == ()  # not even as a retry

    clock.now += CACHE_SECONDS - 0.01
    assert Router().select(REQUEST, snapshot, stats).target.backend_name == "gpu-2"
    clock.now += 0.02
    assert Router().select(REQUEST, snapshot, stats).target.backend_name == "gpu-1"
    assert not cache.is_cached("gpu-1")


def test_more_failures_meanwhile_do_not_put_off_the_next_try(
    refused: aiohttp.ClientError,
) -> None:
    clock = Clock()
    cache, _ = _make_cache(clock)
    assert cache.connect_failed("gpu-1", refused)
    clock.now += 6
    assert not cache.connect_failed("gpu-1", refused)  # in flight before the skip
    clock.now += 4.01
    assert not cache.is_cached("gpu-1")


def test_an_answer_from_the_backend_lets_it_back_at_once(
    refused: aiohttp.ClientError,
) -> None:
    cache, _ = _make_cache(Clock())
    cache.connect_failed("gpu-1", refused)
    cache.record_success("gpu-1")
    assert not cache.is_cached("gpu-1")


def test_zero_seconds_turns_the_cache_off(refused: aiohttp.ClientError) -> None:
    cache, stats = _make_cache(Clock(), seconds=0)
    assert not cache.connect_failed("gpu-1", refused)
    assert Router().select(REQUEST, _snapshot("gpu-1"), stats).target.backend_name
    assert not stats.failed_connections


def test_explain_names_the_backend_the_error_cache_skipped(
    refused: aiohttp.ClientError,
) -> None:
    cache, stats = _make_cache(Clock())
    cache.connect_failed("gpu-1", refused)
    decision = Router().explain(REQUEST, _snapshot("gpu-1", "gpu-2"), stats)
    (excluded,) = decision.as_dict()["excluded"]
    assert excluded["backend"] == "gpu-1"
    assert excluded["reasons"] == [Reason.ERROR_CACHED]
    assert "connection to it failed moments ago" in excluded["detail"]


def test_with_every_candidate_cached_the_least_recently_failed_is_tried(
    refused: aiohttp.ClientError,
) -> None:
    clock = Clock()
    cache, stats = _make_cache(clock)
    cache.connect_failed("gpu-2", refused)
    clock.now += 1
    cache.connect_failed("gpu-3", refused)
    clock.now += 1
    cache.connect_failed("gpu-1", refused)
    snapshot = _snapshot("gpu-1", "gpu-2", "gpu-3")

    route = Router().select(REQUEST, snapshot, stats)
    assert route.target.backend_name == "gpu-2"  # failed longest ago
    assert route.retry_targets == ()
    excluded = {e.target.backend.name for e in route.decision.excluded}
    assert excluded == {"gpu-1", "gpu-3"}


def test_failures_are_logged_once_per_backend_per_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = FailureLog(clock=clock)
    caplog.set_level(logging.WARNING, logger="gateway.error_cache")
    assert log.note("gpu-1", "connection failed (connection refused)")
    for _ in range(4):
        clock.now += 10
        assert not log.note("gpu-1", "HTTP 502")
    assert log.note("gpu-2", "timed out")  # another backend has its own minute
    clock.now += 20.01  # a minute after gpu-1's line
    assert log.note("gpu-1", "HTTP 503")
    assert [r.getMessage() for r in caplog.records] == [
        "Backend gpu-1 failed: connection failed (connection refused)",
        "Backend gpu-2 failed: timed out",
        (
            "Backend gpu-1 failed: HTTP 503 (4 more failures in the 60 s before "
            "were not logged)"
        ),
    ]


def test_another_process_s_failure_is_skipped_here_for_the_same_time() -> None:
    clock = Clock()
    cache, _ = _make_cache(clock)
    cache.on_message(
        {
            "type": "error_cache.failed",
            "backend": "gpu-1",
            "seconds": 10.0,
            "origin": "another-process",
        }
    )
    assert cache.is_cached("gpu-1")
    clock.now += 10.01
    assert not cache.is_cached("gpu-1")
    # Its own announcement coming back, and garbage, change nothing.
    cache.on_message(
        {
            "type": "error_cache.failed",
            "backend": "gpu-1",
            "seconds": 10.0,
            "origin": cache.origin,
        }
    )
    cache.on_message({"type": "error_cache.failed", "backend": "gpu-1"})
    cache.on_message(
        {
            "type": "error_cache.failed",
            "backend": "gpu-1",
            "seconds": 1e9,
            "origin": "x",
        }
    )
    assert not cache.is_cached("gpu-1")


# Real processes.


class PortWatch:
    """Listens on a port, counts the connections made, and answers each
    request with a 503: a live server's error, which must not skip it."""

    BODY = b'{"error": {"message": "busy", "type": "server_error"}}'
    ANSWER = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(BODY), BODY)
    )

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.connected_at: list[float] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.connected_at.append(time.monotonic())
            with conn:
                conn.settimeout(5)
                try:
                    self._read_request(conn)
                    conn.sendall(self.ANSWER)
                except OSError:
                    pass

    @staticmethod
    def _read_request(conn: socket.socket) -> None:
        """Read the request whole, so that closing sends no reset."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return
            body += chunk

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=5)


@contextmanager
def watching(port: int) -> Iterator[PortWatch]:
    watch = PortWatch(port)
    try:
        yield watch
    finally:
        watch.close()


def _two_backends(
    mock_backend_factory: Callable[..., MockBackendProcess], *first_args: str
) -> tuple[MockBackendProcess, MockBackendProcess]:
    """mock-a first by priority (started with `first_args`), mock-b second."""
    first = mock_backend_factory(
        "--models", "llama3:8b", "--name", "mock-a", *first_args
    )
    second = mock_backend_factory("--models", "llama3:8b", "--name", "mock-b")
    for name, mock, priority in (("mock-a", first, 1), ("mock-b", second, 2)):
        backend = Backend.objects.create(
            name=name,
            base_url=mock.base_url,
            priority=priority,
            status=HealthStatus.HEALTHY,
        )
        BackendModel.objects.create(backend=backend, name="llama3:8b")
    policy = RoutingPolicy.load()
    policy.strategy = "priority_only"
    policy.save()
    return first, second


def _explained(server: NexusServer, token: str) -> dict[str, list[str]]:
    answer = httpx.post(
        f"{server.base_url}/api/v1/route/explain",
        json={"model": "llama3:8b"},
        headers={"Authorization": f"Token {token}"},
        timeout=5,
    ).json()
    return {e["backend"]: e["reasons"] for e in answer["excluded"]}


SECONDS = 6.0
ENV = {
    "NEXUS_ERROR_CACHE_SECONDS": str(SECONDS),
    # Only the error cache may keep the dead backend out here.
    "NEXUS_BREAKER_FAILURES": "1000",
    "NEXUS_BREAKER_PERSIST": "false",
}


@pytest.mark.django_db(transaction=True)
def test_a_killed_backend_is_skipped_without_a_connection_until_the_time_is_up(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
    shared_redis_env: dict[str, str],
) -> None:
    dead, alive = _two_backends(mock_backend_factory)
    _, key = ApiKey.objects.create_key("error-cache")
    staff = get_user_model().objects.create_user(
        "ops", is_staff=True, is_superuser=True
    )
    token = Token.objects.create(user=staff).key
    server = nexus_server_factory(**ENV, **shared_redis_env)
    other = nexus_server_factory(**ENV, **shared_redis_env)
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)

    def served_by() -> str:
        reply = sdk.chat.completions.with_raw_response.create(
            model="llama3:8b", messages=[{"role": "user", "content": "hi"}]
        )
        return reply.headers["x-nexus-backend"]

    assert served_by() == "mock-a"
    dead.stop()  # the process is gone: its port refuses connections
    began = time.monotonic()
    # Refused, retried on mock-b at once (a connection pooled before the kill
    # may take one more request to be found closed).
    wait_until(
        lambda: (
            served_by() == "mock-b"
            and "error_cached" in _explained(server, token).get("mock-a", [])
        ),
        timeout=SECONDS / 2,
        what="the refused connection to skip mock-a",
    )

    with watching(dead.port) as port:
        for _ in range(3):
            assert served_by() == "mock-b"
        assert port.connected_at == []  # not even a connection attempt
        assert time.monotonic() - began < SECONDS, "too slow to tell (loaded machine)"
        assert "error_cached" in _explained(server, token)["mock-a"]
        # Every serving process skips it, not only the one that saw it.
        wait_until(
            lambda: "error_cached" in _explained(other, token).get("mock-a", []),
            timeout=5,
            what="the other serving process to hear of the failure",
        )

        # Once the time is up, a request tries it again (the port sees it).
        wait_until(
            lambda: served_by() == "mock-b" and port.connected_at,
            timeout=SECONDS + 15,
            what="a request to try the backend again",
        )
        assert port.connected_at[0] - began >= SECONDS
        assert len(port.connected_at) == 1

    assert mock_stats(alive)["requests"]["/v1/chat/completions"] >= 5
    back = start_mock_backend(
        "--models", "llama3:8b", "--name", "mock-a", "--port", str(dead.port)
    )
    try:
        # Its 503 was a live server's answer: not skipped.
        assert served_by() == "mock-a"
    finally:
        back.stop()

    # Two failures of mock-a within the minute: one line, with the reason.
    lines = [line for line in server.log if "Backend mock-a failed" in line]
    assert len(lines) == 1, lines
    assert "connection" in lines[0]  # refused (or, pooled, closed)
    assert not any("Backend mock-a failed: HTTP 503" in line for line in server.log)


@pytest.mark.django_db(transaction=True)
def test_an_http_error_from_a_live_server_does_not_skip_it(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    failing, _ = _two_backends(mock_backend_factory, "--fail-status", "502")
    _, key = ApiKey.objects.create_key("error-cache")
    server = nexus_server_factory(**ENV)
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    for _ in range(3):
        reply = sdk.chat.completions.with_raw_response.create(
            model="llama3:8b", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.headers["x-nexus-backend"] == "mock-b"
    # Each request asked mock-a first: its 502 is an answer, not an absence.
    assert mock_stats(failing)["requests"]["/v1/chat/completions"] == 3
