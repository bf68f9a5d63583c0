"""Limits that hold for the gateway as a whole: three serving processes, one Redis.

Three Daphne processes share the database and Redis; load comes from the
openai SDK, one client per process. In production mode the Redis is
REDIS_URL's; in the embedded default it is a private one on a Unix socket,
started as nexus_run starts it (nexus_site/private_redis.py), with SQLite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import RoutingPolicy
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey

# Low enough that 15 requests a second empty the bucket within LOAD_SECONDS.
RPM = 300
LOAD_SECONDS = 30.0


@dataclass
class Cluster:
    servers: list[NexusServer]
    mock: MockBackendProcess
    keys: dict[str, str]
    env: dict[str, str]  # what its serving processes share Redis with

    def sdk(self, index: int, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.servers[index].base_url}/v1",
            api_key=self.keys[key],
            max_retries=0,
            timeout=20,
        )


@pytest.fixture(scope="module")
def cluster(
    django_db_setup: None, django_db_blocker, shared_redis_env: dict[str, str]
) -> Iterator[Cluster]:
    mock = start_mock_backend("--models", "llama3:8b,slow:1b", "--name", "mock-w")
    with django_db_blocker.unblock():
        fast = Backend.objects.create(
            name="mock-w", base_url=mock.base_url, status=HealthStatus.HEALTHY
        )
        BackendModel.objects.create(backend=fast, name="llama3:8b")
        slow = Backend.objects.create(
            name="mock-w-two-at-a-time",
            base_url=mock.base_url,
            status=HealthStatus.HEALTHY,
            max_concurrency=2,
        )
        BackendModel.objects.create(backend=slow, name="slow:1b")
        # Admission control would queue the requests over a backend's band
        # (and serve them later): these tests check the caps themselves.
        policy = RoutingPolicy.load()
        policy.admission_enabled = False
        policy.save()
        specs = {"rpm": {"rpm_limit": RPM}, "pair": {"max_concurrency": 2}, "open": {}}
        keys = {
            name: ApiKey.objects.create_key(f"wide-{name}", **limits)[1]
            for name, limits in specs.items()
        }
    servers = []
    try:
        for _ in range(3):
            servers.append(
                start_nexus_server(NEXUS_BREAKER_FAILURES="1000000", **shared_redis_env)
            )
        cluster = Cluster(servers, mock, keys, shared_redis_env)
        for index in range(3):
            # The first request of a process loads its configuration, and the
            # SDK imports its request types on first use: neither may eat into
            # a measurement.
            cluster.sdk(index, "open").chat.completions.create(
                model="llama3:8b", messages=[{"role": "user", "content": "warm"}]
            )
        yield cluster
    finally:
        for server in servers:
            server.stop()
        mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_the_cluster_shares_one_database(cluster: Cluster) -> None:
    assert ApiKey.objects.filter(name__startswith="wide-").count() == 3


def test_three_processes_share_one_rpm_limit_within_one_percent(
    cluster: Cluster,
) -> None:
    """A bucket of RPM requests refilled at RPM a minute: from a fresh start,
    RPM + RPM/60 per second are let through, whichever process serves them."""
    accepted: list[float] = []
    sent: list[float] = []
    refused = 0
    lock = threading.Lock()
    deadline = time.monotonic() + LOAD_SECONDS
    body = {"model": "llama3:8b", "messages": [{"role": "user", "content": "hi"}]}

    def load(index: int) -> None:
        nonlocal refused
        # Plain HTTP: the official SDK's own CPU per call made the clients,
        # not the gateway, the limit on a loaded machine.
        with httpx.Client(
            base_url=cluster.servers[index % 3].base_url,
            headers={"authorization": f"Bearer {cluster.keys['rpm']}"},
            timeout=20,
        ) as client:
            while time.monotonic() < deadline:
                with lock:
                    sent.append(time.monotonic())
                answer = client.post("/v1/chat/completions", json=body)
                if answer.status_code == 429:
                    assert answer.json()["error"]["code"] == "rate_limit_exceeded"
                    with lock:
                        refused += 1
                else:
                    assert answer.status_code == 200, answer.text
                    with lock:
                        accepted.append(time.monotonic())
                time.sleep(1 / 25)  # at most 150 requests a second in all

    # Two clients per process: the bucket must run dry before the end (more
    # than 1.5 RPM requests in LOAD_SECONDS) even on a loaded machine.
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(load, range(6)))
    finished = time.monotonic()

    # From the first request sent to the last answer received.
    expected = RPM + (finished - min(sent)) * RPM / 60
    outcome = {
        "accepted": len(accepted),
        "expected": expected,
        "refused": refused,
        "sent per second": len(sent) / (finished - min(sent)),
        "last answer after last send (s)": finished - max(sent),
    }
    assert refused > 0, outcome
    assert abs(len(accepted) - expected) <= expected * 0.01, outcome


def test_a_backends_max_concurrency_holds_across_processes(cluster: Cluster) -> None:
    httpx.post(
        f"{cluster.mock.base_url}/_mock/config", json={"latency_ms": 1500}, timeout=5
    )
    try:
        statuses = _at_once(cluster, "open", "slow:1b")
    finally:
        httpx.post(f"{cluster.mock.base_url}/_mock/reset", timeout=5)

    assert sorted(statuses) == [200, 200, 503, 503, 503, 503]


def test_a_keys_max_concurrency_holds_across_processes(cluster: Cluster) -> None:
    httpx.post(
        f"{cluster.mock.base_url}/_mock/config", json={"latency_ms": 1500}, timeout=5
    )
    try:
        statuses = _at_once(cluster, "pair", "llama3:8b")
    finally:
        httpx.post(f"{cluster.mock.base_url}/_mock/reset", timeout=5)

    assert sorted(statuses) == [200, 200, 429, 429, 429, 429]


def _at_once(cluster: Cluster, key: str, model: str) -> list[int]:
    """Six requests at once, two to each serving process; their statuses."""
    barrier = threading.Barrier(6)

    def one(index: int) -> int:
        server = cluster.servers[index % 3]
        barrier.wait()
        return httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "x"}]},
            headers={"authorization": f"Bearer {cluster.keys[key]}"},
            timeout=20,
        ).status_code

    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(one, range(6)))


@pytest.mark.parametrize(("mode", "status"), [("open", 200), ("closed", 503)])
def test_an_unreachable_limiter_redis_gets_the_configured_answer(
    cluster: Cluster, mode: str, status: int
) -> None:
    server = start_nexus_server(
        **cluster.env,
        NEXUS_LIMITS_REDIS_URL="redis://127.0.0.1:9/0",
        NEXUS_LIMITS_ON_REDIS_ERROR=mode,
        NEXUS_LIMITS_REDIS_TIMEOUT="0.2",
    )
    try:
        answers = [
            httpx.post(
                f"{server.base_url}/v1/chat/completions",
                json={
                    "model": "llama3:8b",
                    "messages": [{"role": "user", "content": "x"}],
                },
                headers={"authorization": f"Bearer {cluster.keys['rpm']}"},
                timeout=20,
            )
            for _ in range(3)
        ]
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    finally:
        server.stop()

    assert [a.status_code for a in answers] == [status] * 3
    if status == 503:
        assert answers[0].json()["error"]["code"] == "limits_unavailable"
    assert "nexus_limiter_errors_total" in metrics
    errors = [
        line
        for line in metrics.splitlines()
        if line.startswith("nexus_limiter_errors_total")
    ]
    assert float(errors[0].split()[-1]) >= 1
