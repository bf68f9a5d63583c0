"""Passive failure detection end to end: the proxy opens a backend's breaker.

Real Daphne processes, real mock backends, the official SDK. In production mode
the opening also reaches a second serving process over the Channels layer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import RoutingPolicy
from tests.conftest import MockBackendProcess, NexusServer
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)

FAILURES = 3
PRODUCTION = os.environ.get("NEXUS_TEST_MODE") == "production"


def _explain(server: NexusServer, token: str) -> dict:
    return httpx.post(
        f"{server.base_url}/api/v1/route/explain",
        json={"model": "llama3:8b"},
        headers={"Authorization": f"Token {token}"},
        timeout=5,
    ).json()


def test_failures_seen_by_the_proxy_open_the_breaker_before_any_probe(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    failing = mock_backend_factory(
        "--models", "llama3:8b", "--name", "mock-a", "--fail-status", "500"
    )
    healthy = mock_backend_factory("--models", "llama3:8b", "--name", "mock-b")
    for name, mock, priority in (("mock-a", failing, 1), ("mock-b", healthy, 2)):
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
    _, key = ApiKey.objects.create_key("breaker")
    staff = get_user_model().objects.create_user(
        "breaker-ops", is_staff=True, is_superuser=True
    )
    token = Token.objects.create(user=staff).key
    env = {
        "NEXUS_BREAKER_FAILURES": str(FAILURES),
        "NEXUS_BREAKER_COOLDOWN": "60",
        "NEXUS_BREAKER_PERSIST": "false",  # only the proxy's own view counts here
    }
    first, second = nexus_server_factory(**env), nexus_server_factory(**env)
    for server in (first, second):
        assert _explain(server, token)["chosen"]["backend"] == "mock-a"

    sdk = openai.OpenAI(base_url=f"{first.base_url}/v1", api_key=key, max_retries=0)
    for i in range(FAILURES):
        reply = sdk.chat.completions.with_raw_response.create(
            model="llama3:8b", messages=[{"role": "user", "content": str(i)}]
        )
        assert reply.headers["x-nexus-backend"] == "mock-b"  # retried, no error
    tried = httpx.get(f"{failing.base_url}/_mock/stats").json()["requests"]
    assert tried["/v1/chat/completions"] == FAILURES

    for i in range(5):
        reply = sdk.chat.completions.with_raw_response.create(
            model="llama3:8b", messages=[{"role": "user", "content": str(i)}]
        )
        assert reply.headers["x-nexus-backend"] == "mock-b"
    after = httpx.get(f"{failing.base_url}/_mock/stats").json()["requests"]
    assert after["/v1/chat/completions"] == FAILURES  # the open breaker held

    excluded = {e["backend"]: e["reasons"] for e in _explain(first, token)["excluded"]}
    assert "circuit_open" in excluded["mock-a"]
    if PRODUCTION:
        deadline = time.monotonic() + 2
        while True:
            excluded = {
                e["backend"]: e["reasons"] for e in _explain(second, token)["excluded"]
            }
            if "circuit_open" in excluded.get("mock-a", []):
                break
            assert time.monotonic() < deadline, "the opening did not reach process 2"
            time.sleep(0.05)
