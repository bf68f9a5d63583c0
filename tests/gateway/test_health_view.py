"""GET /health: what load balancers and monitoring see."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token

from backends.models import Backend, HealthStatus
from gateway.process import current_gateway
from tests.factories import BackendFactory, BackendModelFactory

pytestmark = pytest.mark.django_db

SECRET = "sk-upstream-Zq8v3LmT0pXw"


@pytest.fixture(autouse=True)
def _closed_circuits() -> Iterator[None]:
    yield
    stats = current_gateway().stats
    for name in list(stats.open_circuits):
        stats.close_circuit(name)


def test_health_is_200_with_every_backend_and_a_summary(admin_client: Client) -> None:
    up = BackendFactory(name="gpu-1", avg_latency_ms=12.34, priority=1)
    BackendModelFactory(backend=up)
    BackendFactory(name="gpu-2", unhealthy=True, priority=2)
    BackendFactory(name="gpu-3", status=HealthStatus.DRAINING, priority=3)
    BackendFactory(name="gpu-4", disabled=True, status=HealthStatus.UNKNOWN)
    response = admin_client.get("/health")
    assert response.status_code == 200
    assert response["Cache-Control"].startswith("max-age=0")
    body = response.json()
    assert body["status"] == "degraded"
    assert body["summary"] == {
        "total": 4,
        "healthy": 1,
        "unhealthy": 1,
        "draining": 1,
        "unknown": 0,
        "disabled": 1,
        "stale": 0,
    }
    first = body["backends"][0]
    assert first == {
        "name": "gpu-1",
        "kind": "openai",
        "url": up.base_url,
        "enabled": True,
        "status": "healthy",
        "version": None,
        "circuit_open": False,
        "error_cached": False,
        "latency_ms": 12.3,
        "last_check_at": None,
        "stale": False,
        "last_error": "",
        "models": 1,
    }
    assert body["backends"][1]["last_error"] == "connection refused"


def test_health_is_ok_when_every_enabled_backend_serves(client: Client) -> None:
    BackendFactory()
    BackendFactory(disabled=True, unhealthy=True)
    assert client.get("/health").json()["status"] == "ok"


def test_health_is_503_when_no_backend_is_healthy(client: Client) -> None:
    BackendFactory(unhealthy=True)
    BackendFactory(status=HealthStatus.UNKNOWN)
    BackendFactory(disabled=True)  # healthy but switched off
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"


def test_health_is_503_without_any_backend(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="django.request"):
        response = client.get("/health")
    assert response.status_code == 503
    body = response.json()
    assert body["summary"]["total"] == 0
    # What to do next, and no ERROR line for every probe of this state.
    assert "No backend is configured" in body["hint"]
    assert "nexus_import_config" in body["hint"]
    assert caplog.records == []


def test_a_503_with_backends_says_where_to_look(client: Client) -> None:
    BackendFactory(unhealthy=True)
    assert "nexus_check_health" in client.get("/health").json()["hint"]
    BackendFactory()
    assert "hint" not in client.get("/health").json()


def test_a_backend_with_an_open_circuit_does_not_count_as_serving(
    admin_client: Client,
) -> None:
    BackendFactory(name="gpu-1")
    stats = current_gateway().stats
    stats.open_circuit("gpu-1", stats.clock() + 60)
    response = admin_client.get("/health")
    assert response.status_code == 503
    assert response.json()["backends"][0]["circuit_open"] is True


def test_health_never_shows_keys_or_url_credentials(admin_client: Client) -> None:
    # Rows written around the admin's validation (API, shell, old imports).
    Backend.objects.bulk_create(
        [
            Backend(
                name="leaky",
                base_url="https://user:hunter2@llm.internal:8443/v1?token=abc",
                api_key=SECRET,
                status=HealthStatus.UNHEALTHY,
                last_error=f"upstream said: bad key {SECRET}",
            )
        ]
    )
    response = admin_client.get("/health")
    text = response.content.decode()
    for secret in (SECRET, "hunter2", "user:", "token=abc"):
        assert secret not in text
    assert response.json()["backends"][0]["url"] == "https://llm.internal:8443"


def test_health_answers_get_and_head_only(client: Client) -> None:
    BackendFactory()
    assert client.head("/health").status_code == 200
    assert client.post("/health").status_code == 405


def test_anonymous_health_is_a_summary_without_backend_details(
    client: Client,
) -> None:
    BackendFactory(name="gpu-internal", base_url="http://10.1.2.3:11434")
    response = client.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"status", "database", "summary"}
    assert body["summary"]["healthy"] == 1
    assert "10.1.2.3" not in response.content.decode()
    assert "gpu-internal" not in response.content.decode()


def test_a_staff_token_gets_backend_details(client: Client, admin_user) -> None:
    BackendFactory(name="gpu-1")
    token = Token.objects.create(user=admin_user)
    response = client.get("/health", HTTP_AUTHORIZATION=f"Token {token.key}")
    assert [row["name"] for row in response.json()["backends"]] == ["gpu-1"]
    wrong = client.get("/health", HTTP_AUTHORIZATION="Token nope")
    assert "backends" not in wrong.json()


def test_a_stale_healthy_backend_counts_as_unknown(
    admin_client: Client, settings
) -> None:
    settings.NEXUS_HEALTH_INTERVAL = 10.0
    BackendFactory(name="gpu-1", last_check_at=timezone.now() - timedelta(seconds=31))
    response = admin_client.get("/health")
    assert response.status_code == 503
    body = response.json()
    assert (body["summary"]["healthy"], body["summary"]["unknown"]) == (0, 1)
    assert body["summary"]["stale"] == 1
    assert body["backends"][0]["stale"] is True
