"""One tenant's input cannot open a breaker other tenants depend on (issue 27, item 1).

The red team's attack, repeated here: six requests whose content makes a
backend fail (a body the relay cannot carry, a prompt that makes the model
server answer 500) opened the breaker of every backend serving the model, and
other keys got 503 for the cool-down. Real Daphne processes, mock backends and
relay workers; in production mode the attacker and the victim reach different
serving processes (both see both tenants, as behind one listening socket).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from backends.models import Backend, BackendModel, HealthStatus, Worker
from tests.conftest import MockBackendProcess, NexusServer
from tests.gateway.relay_workers import WorkerProcess, start_worker
from tests.gateway.test_relay_e2e import (
    HEARTBEAT,
    wait_registered,
    wait_routable,
    wait_until_live,
)
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)

PRODUCTION = os.environ.get("NEXUS_TEST_MODE") == "production"
POISON = "POISON-PILL"
ATTACK = 6  # requests, one more than the breaker's K
BREAKER = {
    "NEXUS_BREAKER_FAILURES": str(ATTACK - 1),
    # Long enough that a loaded machine's slow requests all fall in one window.
    "NEXUS_BREAKER_WINDOW": "120",
    "NEXUS_BREAKER_COOLDOWN": "120",
    "NEXUS_BREAKER_PERSIST": "false",
}


def _chat(server: NexusServer, key: str, model: str, content: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": content}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def _statuses(
    server: NexusServer, key: str, model: str, count: int = ATTACK
) -> list[int]:
    return [_chat(server, key, model, f"hello {i}").status_code for i in range(count)]


def _add_backend(name: str, mock: MockBackendProcess, *models: str) -> None:
    backend = Backend.objects.create(
        name=name, base_url=mock.base_url, status=HealthStatus.HEALTHY
    )
    for model in models:
        BackendModel.objects.create(backend=backend, name=model)


def test_six_poisoned_requests_leave_other_keys_of_a_direct_backend_at_200(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    poisoned = ("--fail-on-text", POISON, "--fail-status", "500")
    # One backend serving two models: the red team's attacker used one, its
    # victim the other. Two backends serving a third: a 500 that repeats on
    # the retry is the input's, not either backend's.
    solo = mock_backend_factory("--models", "llama3:8b,qwen:7b", *poisoned)
    _add_backend("solo", solo, "llama3:8b", "qwen:7b")
    for name in ("pair-a", "pair-b"):
        pair = mock_backend_factory("--models", "mistral:7b", *poisoned)
        _add_backend(name, pair, "mistral:7b")
    _, attacker = ApiKey.objects.create_key("attacker")
    _, victim = ApiKey.objects.create_key("victim")
    first = nexus_server_factory(**BREAKER)
    # Production: an opening in one process reaches the other over Redis.
    second = nexus_server_factory(**BREAKER) if PRODUCTION else first
    for server in (first, second):
        assert _statuses(server, victim, "qwen:7b", 2) == [200, 200]

    attacked = [
        _chat(first, attacker, model, f"please {POISON}").status_code
        for model in ("llama3:8b", "mistral:7b")
        for _ in range(ATTACK)
    ]

    for server in (first, second):
        victims = {m: _statuses(server, victim, m) for m in ("qwen:7b", "mistral:7b")}
        assert victims == {"qwen:7b": [200] * ATTACK, "mistral:7b": [200] * ATTACK}
    # The attacker got the backends' answer to its input every time.
    assert attacked == [500] * 2 * ATTACK


def test_six_bodies_a_relay_cannot_carry_leave_other_keys_of_its_workers_at_200(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    server = nexus_server_factory(NEXUS_RELAY_HEARTBEAT_SECONDS=HEARTBEAT, **BREAKER)
    workers: list[WorkerProcess] = []
    try:
        for name in ("gpu-a", "gpu-b"):
            mock = mock_backend_factory(
                "--models", "llama3:8b", "--name", name, "--fail-on-text", POISON
            )
            _, secret = Worker.objects.create_worker(name)
            workers.append(
                start_worker(
                    server, mock, secret, "--backend-kind", "openai", "--name", name
                )
            )
            wait_registered(name)
        _, attacker = ApiKey.objects.create_key("attacker")
        _, victim = ApiKey.objects.create_key("victim")
        wait_until_live(server)
        for name in ("gpu-a", "gpu-b"):
            wait_routable(server, name)

        body = '{"model": "llama3:8b", "messages": [{"role": "user", "content": "hi"}]}'
        attacked: list[tuple[int, Any]] = []
        for _ in range(ATTACK):
            answer = httpx.post(
                f"{server.base_url}/v1/chat/completions",
                content=body.encode("utf-16"),
                headers={
                    "Authorization": f"Bearer {attacker}",
                    "Content-Type": "application/json",
                },
                timeout=60,
            )
            attacked.append((answer.status_code, answer.json()["error"]))
        attacked += [
            (answer.status_code, answer.json()["error"]["code"])
            for answer in (
                _chat(server, attacker, "llama3:8b", f"please {POISON}")
                for _ in range(ATTACK)
            )
        ]

        assert _statuses(server, victim, "llama3:8b") == [200] * ATTACK
        # The client's own mistake, said in OpenAI's shape.
        for status, error in attacked[:ATTACK]:
            assert status == 400
            assert "UTF-8" in error["message"]
            assert error["type"] == "invalid_request_error"
        # The local backend's answer to that input, from whichever worker.
        assert attacked[ATTACK:] == [(500, "mock_injected_failure")] * ATTACK
    finally:
        for worker in workers:
            worker.kill()
