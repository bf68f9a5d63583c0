"""A worker is sent only the models its credential allows (issue 27, item 8).

Red team: a worker could claim any model name, one a trusted direct backend
serves included; once that backend's breaker was open the hostile worker got
100 of 100 of another tenant's prompts. Real Daphne processes, the real
nexus-worker in front of mock backends, workers created with the command and
edited through the management API; in production mode the client reaches
another serving process than the one holding the worker's socket.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from io import StringIO

import httpx
import pytest
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus, Worker
from backends.worker_models import NOT_ALLOWED, SERVED_DIRECTLY
from tests.conftest import MockBackendProcess, NexusServer, mock_stats, wait_until
from tests.gateway.relay_workers import WorkerProcess
from tests.gateway.test_relay_e2e import (
    HEARTBEAT,
    _staff_headers,
    wait_registered,
    wait_routable,
    wait_until_live,
    worker_factory,  # noqa: F401 (a fixture)
)
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)

PRODUCTION = os.environ.get("NEXUS_TEST_MODE") == "production"
CHAT = "/v1/chat/completions"
wait_for = functools.partial(wait_until, timeout=15.0)


def _servers(factory: Callable[..., NexusServer], **env: str) -> list[NexusServer]:
    """One serving process; two in production mode (the worker's and another)."""
    first = factory(NEXUS_RELAY_HEARTBEAT_SECONDS=HEARTBEAT, **env)
    if not PRODUCTION:
        return [first]
    return [first, factory(NEXUS_RELAY_HEARTBEAT_SECONDS=HEARTBEAT, **env)]


def _create_worker(name: str, *args: str) -> str:
    """Create a worker as an operator would (the command); return its secret."""
    out = StringIO()
    call_command("nexus_create_worker", name, *args, "--json", stdout=out)
    return str(json.loads(out.getvalue())["secret"])


def _chat(server: NexusServer, key: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}{CHAT}",
        json={"model": model, "messages": [{"role": "user", "content": "secret"}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def _chats(mock: MockBackendProcess) -> int:
    return int(mock_stats(mock)["requests"].get(CHAT, 0))


def _refused(name: str) -> list[dict[str, str]]:
    return list(Worker.objects.get(name=name).refused_models)


def test_a_worker_gets_no_traffic_for_a_name_outside_its_allow_list(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
    worker_factory: Callable[..., WorkerProcess],  # noqa: F811
) -> None:
    servers = _servers(nexus_server_factory)
    mock = mock_backend_factory("--models", "llama3:8b,qwen:7b", "--name", "gpu-a")
    secret = _create_worker("gpu-a", "--models", "llama3:*")
    worker = worker_factory(servers[0], secret, mock, "--name", "gpu-a")
    _, key = ApiKey.objects.create_key("tenant")
    wait_registered("gpu-a")
    wait_until_live(*servers)

    for server in servers:
        wait_routable(server, "gpu-a", "llama3:8b")  # the glob admits it
        served = _chat(server, key, "llama3:8b")
        assert served.status_code == 200, served.text
        assert served.headers["x-nexus-backend"] == "gpu-a"
        refused = _chat(server, key, "qwen:7b")
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
        listed = httpx.get(
            f"{server.base_url}/v1/models",
            headers={"Authorization": f"Bearer {key}"},
            timeout=10,
        ).json()
        assert [m["id"] for m in listed["data"]] == ["llama3:8b"]
    assert _chats(mock) == len(servers)  # the llama3:8b requests only
    # The operator sees what was refused and why; so does the worker's log.
    assert _refused("gpu-a") == [{"name": "qwen:7b", "reason": NOT_ALLOWED}]
    wait_for(lambda: worker.logged("models_refused"))
    assert worker.logged(f"{NOT_ALLOWED}: qwen:7b")

    # The operator widens the list through the API: the worker is asked for
    # its models again and is sent the name from then on.
    headers = _staff_headers()
    pk = Worker.objects.get(name="gpu-a").pk
    edited = httpx.patch(
        f"{servers[0].base_url}/api/v1/workers/{pk}",
        json={"allowed_models": "llama3:*, qwen:*"},
        headers=headers,
        timeout=10,
    )
    assert edited.status_code == 200, edited.text
    wait_for(lambda: _refused("gpu-a") == [])
    wait_until_live(*servers)
    for server in servers:
        wait_routable(server, "gpu-a", "qwen:7b")
        answer = _chat(server, key, "qwen:7b")
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-nexus-backend"] == "gpu-a"


def test_a_hostile_worker_gets_no_prompt_of_a_direct_backends_model(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
    worker_factory: Callable[..., WorkerProcess],  # noqa: F811
) -> None:
    """Red team (issue 27, item 8): even with the direct backend down and its
    breaker open, the worker claiming its model gets none of its prompts; the
    tenant gets the gateway's 502/503 instead."""
    trusted = mock_backend_factory("--models", "llama3:8b", "--name", "trusted")
    backend = Backend.objects.create(
        name="trusted", base_url=trusted.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name="llama3:8b")
    servers = _servers(
        nexus_server_factory,
        NEXUS_BREAKER_FAILURES="3",
        NEXUS_BREAKER_WINDOW="120",
        NEXUS_BREAKER_COOLDOWN="120",
        NEXUS_BREAKER_PERSIST="false",
    )
    hostile = mock_backend_factory("--models", "llama3:8b", "--name", "evil")
    secret = _create_worker("evil")  # an allow-list admitting any name
    worker = worker_factory(servers[0], secret, hostile, "--name", "evil")
    keys = [ApiKey.objects.create_key(f"tenant-{i}")[1] for i in range(2)]
    wait_registered("evil")
    wait_until_live(*servers)
    assert _refused("evil") == [{"name": "llama3:8b", "reason": SERVED_DIRECTLY}]
    wait_for(lambda: worker.logged("models_refused"))

    for server in servers:
        for i in range(10):
            answer = _chat(server, keys[i % 2], "llama3:8b")
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-nexus-backend"] == "trusted"

    trusted.stop()
    first = servers[0]
    opened = "nexus_breaker_openings_total"
    # Two tenants' failures open the direct backend's breaker.
    statuses = [_chat(first, keys[0], "llama3:8b").status_code]
    for i in range(20):
        if first.metric(opened):
            break
        statuses.append(_chat(first, keys[i % 2], "llama3:8b").status_code)
    assert first.metric(opened) >= 1
    for server in servers:
        answers = [_chat(server, keys[i % 2], "llama3:8b") for i in range(20)]
        statuses += [answer.status_code for answer in answers]
        assert not any("x-nexus-backend" in answer.headers for answer in answers)
    assert set(statuses) <= {502, 503}
    assert statuses[-1] == 503
    assert _chats(hostile) == 0

    # An operator who trusts the worker lets it serve the name: the same worker
    # (it had claimed the name all along) is then sent it.
    pk = Worker.objects.get(name="evil").pk
    edited = httpx.patch(
        f"{servers[0].base_url}/api/v1/workers/{pk}",
        json={"may_shadow_direct_backends": True},
        headers=_staff_headers(),
        timeout=10,
    )
    assert edited.status_code == 200, edited.text
    wait_until_live(*servers)
    for server in servers:
        wait_routable(server, "evil", "llama3:8b")
        answer = _chat(server, keys[0], "llama3:8b")
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-nexus-backend"] == "evil"
    assert _chats(hostile) == len(servers)
