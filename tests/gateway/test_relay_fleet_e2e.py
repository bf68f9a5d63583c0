"""Relay workers as fleet nodes, end to end: Daphne serving Nexus under the fleet
strategy, mock Ollama nodes, the real nexus-worker in front of one of them, the
openai SDK as client.

The worker reads its Ollama's /api/ps (as the health round reads a direct
backend's) and sends what is loaded with every heartbeat; the fleet score
reads it from the same fields as a direct backend's probe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import openai
import pytest

from backends.models import Backend, BackendModel, HealthStatus, Worker
from routing.models import RoutingPolicy
from tests.conftest import MockBackendProcess, NexusServer, wait_until
from tests.gateway.relay_workers import WorkerProcess, start_worker
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "hi"}]
Factory = Callable[..., MockBackendProcess]


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.kill()


def _fleet_policy() -> None:
    policy = RoutingPolicy.load()
    policy.strategy = "fleet"
    policy.full_clean()
    policy.save()


def _node(factory: Factory, name: str, loaded: str) -> MockBackendProcess:
    return factory(
        "--kind",
        "ollama",
        "--name",
        name,
        "--model",
        "m:4",
        "--memory-gb",
        "16",
        "--loaded-models",
        loaded,
    )


def _loaded_at(backend: str) -> bool:
    return BackendModel.objects.filter(
        backend__name=backend, name="m", loaded=True
    ).exists()


def test_a_worker_reporting_a_hot_model_wins_over_a_direct_backend_where_it_is_cold(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
    workers: list[WorkerProcess],
) -> None:
    """Everything else equal, the direct backend wins the tie (priority 0 to
    the worker's 10): only the worker's report of "m" loaded (+50 hot against
    +10 on disk) sends the request to it."""
    _fleet_policy()
    cold = _node(mock_backend_factory, "direct", loaded="")
    direct = Backend.objects.create(
        name="direct",
        base_url=cold.base_url,
        kind="ollama",
        status=HealthStatus.HEALTHY,
        priority=0,
    )
    BackendModel.objects.create(backend=direct, name="m", loaded=False)
    hot = _node(mock_backend_factory, "relayed", loaded="m")
    _, secret = Worker.objects.create_worker(
        "gpu-relay", may_shadow_direct_backends=True
    )
    _, key = ApiKey.objects.create_key("relay-fleet")
    server = nexus_server_factory(NEXUS_RELAY_HEARTBEAT_SECONDS="1")
    workers.append(
        start_worker(
            server, hot, secret, "--backend-kind", "ollama", "--name", "gpu-relay"
        )
    )
    # The worker's report reached the database (and so every snapshot).
    wait_until(lambda: _loaded_at("gpu-relay"), what="the worker's loaded model")
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=30
    )

    def served_by_the_worker() -> bool:
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES
        )
        return raw.headers["x-nexus-backend"] == "gpu-relay"

    # The first answers may come from the direct backend until the serving
    # process's snapshot has the report; then every one goes to the worker.
    wait_until(served_by_the_worker, what="a request served by the worker")
    for _ in range(3):
        assert served_by_the_worker()
    assert not _loaded_at("direct")


def test_a_model_unloaded_at_the_worker_is_cold_in_the_database_soon(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
    workers: list[WorkerProcess],
) -> None:
    """A change is written when the next heartbeat brings it, not at the
    liveness write (30 s by default)."""
    import httpx

    node = _node(mock_backend_factory, "relayed", loaded="m")
    _, secret = Worker.objects.create_worker("gpu-relay")
    server = nexus_server_factory(NEXUS_RELAY_HEARTBEAT_SECONDS="1")
    workers.append(
        start_worker(
            server,
            node,
            secret,
            "--backend-kind",
            "ollama",
            "--name",
            "gpu-relay",
            "--memory-gb",
            "16",
        )
    )
    wait_until(lambda: _loaded_at("gpu-relay"), what="the worker's loaded model")
    row = BackendModel.objects.get(backend__name="gpu-relay", name="m")
    assert row.vram_bytes == 4 * 10**9
    relay = Backend.objects.get(name="gpu-relay")
    assert (relay.memory_total_bytes, relay.memory_used_bytes) == (
        16 * 10**9,
        4 * 10**9,
    )
    # keep_alive 0 unloads it at once (as Ollama does).
    httpx.post(
        f"{node.base_url}/api/generate",
        json={"model": "m", "keep_alive": 0},
        timeout=10,
    )
    wait_until(lambda: not _loaded_at("gpu-relay"), timeout=10, what="the unload")
