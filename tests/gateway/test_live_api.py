"""GET /api/v1/usage/live: the serving process's requests in flight right now."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from gateway.process import current_gateway
from routing.core import BackendSpec
from tests.factories import UsageEventFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(
        get_user_model().objects.create_user("ops", is_staff=True, is_superuser=True)
    )
    return client


@pytest.fixture
def load() -> Iterator[None]:
    """Requests in flight in this process, as the proxy counts them."""
    gateway = current_gateway()
    pairs = [
        ("gpu-live-1", "llama3:8b"),
        ("gpu-live-1", "mistral:7b"),
        ("gpu-live-2", "llama3:8b"),
    ]
    for backend, model in pairs:
        assert gateway.stats.try_begin(BackendSpec(backend, "http://gpu"), model)
    gateway.buffer.drain()
    gateway.buffer.append(UsageEventFactory())
    yield
    for backend, model in pairs:
        gateway.stats.end(backend, model)
    gateway.buffer.drain()


@pytest.mark.usefixtures("load")
def test_live_shows_requests_in_flight_per_backend_now(api: APIClient) -> None:
    body = api.get("/api/v1/usage/live").json()

    rows = {row["backend"]: row for row in body["backends"]}
    assert rows["gpu-live-1"]["in_flight"] == 2
    assert rows["gpu-live-2"]["in_flight"] == 1
    pairs = {(row["backend"], row["model"]): row["in_flight"] for row in body["models"]}
    assert pairs == {
        ("gpu-live-1", "llama3:8b"): 1,
        ("gpu-live-1", "mistral:7b"): 1,
        ("gpu-live-2", "llama3:8b"): 1,
    }
    assert body["in_flight"] == 3
    assert body["buffered_events"] == 1
    assert body["process"] > 0


def test_live_needs_staff() -> None:
    assert APIClient().get("/api/v1/usage/live").status_code in (401, 403)
