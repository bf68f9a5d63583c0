"""Ollama model management through a relay worker, with real processes.

An Ollama mock behind the real nexus-worker, which dials in to a Daphne
serving Nexus; the official ollama client with a key that may manage models.
A worker started with --allow-model-management pulls (progress streamed
through the relay), copies and deletes (DELETE) on its Ollama, and the
gateway lists the change when the answer ends; a worker without it refuses,
and the client reads why. A client leaving mid-pull ends the pull at the
worker's Ollama.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import ollama
import pytest

from backends.models import Worker
from tests.conftest import MockBackendProcess, NexusServer, mock_stats, wait_until
from tests.gateway.relay_workers import WorkerProcess, start_worker
from tests.gateway.test_relay_e2e import (
    RELAY_ENV,
    wait_registered,
    wait_routable,
    wait_until_live,
)
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "llama3:8b"
PULL_LINES = 9


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.kill()


Start = Callable[..., MockBackendProcess]


@pytest.fixture
def relay(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
    workers: list[WorkerProcess],
) -> tuple[NexusServer, str, Start]:
    server = nexus_server_factory(**RELAY_ENV)
    _, key = ApiKey.objects.create_key("relay-ops", can_manage_models=True)

    def start(name: str, *worker_args: str) -> MockBackendProcess:
        mock = mock_backend_factory(
            "--kind", "ollama", "--models", MODEL, "--name", name
        )
        _, secret = Worker.objects.create_worker(name)
        workers.append(
            start_worker(
                server,
                mock,
                secret,
                "--backend-kind",
                "ollama",
                "--name",
                name,
                *worker_args,
            )
        )
        wait_registered(name)
        wait_until_live(server)
        wait_routable(server, name)
        return mock

    return server, key, start


def _client(server: NexusServer, key: str, backend: str) -> ollama.Client:
    return ollama.Client(
        host=server.base_url,
        headers={"Authorization": f"Bearer {key}", "x-nexus-backend": backend},
        timeout=30,
    )


def _listed(server: NexusServer, key: str) -> set[str]:
    return {m.model or "" for m in _client(server, key, "").list().models}


def test_a_worker_that_allows_it_pulls_copies_and_deletes(
    relay: tuple[NexusServer, str, Start],
) -> None:
    server, key, start = relay
    mock = start("gpu-far", "--allow-model-management")
    httpx.post(f"{mock.base_url}/_mock/config", json={"chunk_delay_ms": 200}, timeout=5)
    client = _client(server, key, "gpu-far")
    arrived = [
        (time.monotonic(), part) for part in client.pull("qwen3:0.6b", stream=True)
    ]
    assert arrived[0][1].status == "pulling manifest"
    assert arrived[-1][1].status == "success" and len(arrived) == PULL_LINES
    # Relayed as the worker's Ollama sent them, not gathered at the end.
    assert arrived[-1][0] - arrived[0][0] >= 1.0
    # The worker lists its models again at once and reports them.
    wait_until(lambda: "qwen3:0.6b" in _listed(server, key), timeout=10)
    reply = client.chat(
        model="qwen3:0.6b", messages=[{"role": "user", "content": "hi"}], stream=False
    )
    assert "gpu-far/qwen3:0.6b" in (reply.message.content or "")
    assert client.pull("phi3:mini", stream=False).status == "success"
    client.copy("qwen3:0.6b", "qwen3:mine")
    wait_until(lambda: "qwen3:mine" in _listed(server, key), timeout=10)
    client.delete("qwen3:mine")  # DELETE /api/delete through the relay
    wait_until(lambda: "qwen3:mine" not in _listed(server, key), timeout=10)
    requests = mock_stats(mock)["requests"]
    assert requests["/api/pull"] == 2 and requests["/api/delete"] == 1
    with pytest.raises(ollama.ResponseError) as caught:
        client.delete("qwen3:mine")  # the worker's Ollama's own 404, passed on
    assert caught.value.status_code == 404


def test_a_worker_that_does_not_allow_it_says_why(
    relay: tuple[NexusServer, str, Start],
) -> None:
    server, key, start = relay
    mock = start("gpu-shut")
    with pytest.raises(ollama.ResponseError) as caught:
        _client(server, key, "gpu-shut").pull("qwen3:0.6b")
    assert caught.value.status_code == 501
    assert "--allow-model-management" in caught.value.error
    assert mock_stats(mock)["requests"].get("/api/pull", 0) == 0


def test_a_client_leaving_mid_pull_ends_it_at_the_workers_ollama(
    relay: tuple[NexusServer, str, Start],
) -> None:
    server, key, start = relay
    mock = start("gpu-left", "--allow-model-management")
    httpx.post(f"{mock.base_url}/_mock/config", json={"chunk_delay_ms": 500}, timeout=5)
    with httpx.stream(
        "POST",
        f"{server.base_url}/api/pull?backend=gpu-left",
        json={"model": "left:7b"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    ) as answer:
        assert answer.status_code == 200
        next(answer.iter_lines())
    wait_until(
        lambda: mock_stats(mock)["client_disconnects"] == 1,
        timeout=3,
        what="the worker's Ollama to see its client go",
    )
    wait_until(lambda: mock_stats(mock)["in_flight"] == 0, timeout=3)
    assert "left:7b" not in _listed(server, key)
