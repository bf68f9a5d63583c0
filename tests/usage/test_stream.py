"""The live usage stream through real processes: Daphne, a mock backend, the SDK."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import MockBackendProcess, NexusServer
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "llama3:8b"


@dataclass
class Setup:
    server: NexusServer
    key: str
    token: str

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.server.base_url}/v1", api_key=self.key, max_retries=0
        )

    def chat(self, text: str = "hello there") -> int:
        reply = self.sdk().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}]
        )
        assert reply.usage is not None
        return reply.usage.total_tokens


class EventReader:
    """Parse Server-Sent Events from a streaming httpx response."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.iter_lines()

    def next(self) -> tuple[str, dict[str, Any]]:
        name, data = "message", ""
        for line in self._lines:
            if line.startswith("event:"):
                name = line.partition(":")[2].strip()
            elif line.startswith("data:"):
                data += line.partition(":")[2].strip()
            elif line == "" and data:
                return name, json.loads(data)
        raise AssertionError("the stream ended")

    def until(
        self, predicate: Callable[[dict[str, Any]], bool], limit: float = 15.0
    ) -> dict[str, Any]:
        """Read events until one matches (the read timeout stops a silent one)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            name, event = self.next()
            assert name == "update"
            if predicate(event):
                return event
        raise AssertionError("no matching event arrived")


def _series(event: dict[str, Any]) -> dict[str, Any] | None:
    for row in event["series"]:
        if row["backend"] == "mock-stream" and row["model"] == MODEL:
            return row
    return None


def _requests(event: dict[str, Any]) -> int:
    row = _series(event)
    return row["requests"] if row else 0


@pytest.fixture
def setup(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> Setup:
    mock = mock_backend_factory("--models", MODEL, "--name", "mock-stream")
    backend = Backend.objects.create(
        name="mock-stream", base_url=mock.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name=MODEL)
    Backend.objects.create(
        name="gpu-down",
        base_url="http://127.0.0.1:9",
        status=HealthStatus.UNHEALTHY,
        last_error="connection refused",
    )
    _, key = ApiKey.objects.create_key("stream-tests")
    admin = User.objects.create_user("stream-admin", is_staff=True, is_superuser=True)
    token = Token.objects.create(user=admin)
    return Setup(nexus_server_factory(), key, token.key)


@contextmanager
def open_stream(setup: Setup, **headers: str) -> Iterator[EventReader]:
    headers = {"Authorization": f"Token {setup.token}"} | headers
    with (
        httpx.Client(timeout=httpx.Timeout(10.0)) as client,
        client.stream(
            "GET", f"{setup.server.base_url}/api/usage-stream", headers=headers
        ) as response,
    ):
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        yield EventReader(response)


def test_stream_sends_a_snapshot_then_the_usage_of_a_chat_request(
    setup: Setup,
) -> None:
    with open_stream(setup) as stream:
        name, snapshot = stream.next()
        assert name == "snapshot"
        assert _requests(snapshot) == 0
        health = {b["name"]: b for b in snapshot["backends"]}
        assert health["mock-stream"]["status"] == "healthy"
        assert health["gpu-down"]["status"] == "unhealthy"
        assert health["gpu-down"]["last_error"] == "connection refused"
        assert snapshot["subscribers"] == 1

        tokens = setup.chat()

        event = stream.until(lambda e: _requests(e) == 1)
        row = _series(event)
        assert row is not None
        assert row["errors"] == 0
        assert row["total_tokens"] == tokens > 0
        assert row["in_flight"] == 0
        (latency,) = [x for x in event["latency"] if x["model"] == MODEL]
        assert latency["samples"] == 1
        assert latency["p50_ms"] is not None
        assert latency["p95_ms"] == latency["p50_ms"]
        # The finished request, in its time slot (the five-minute chart).
        (slot,) = event["recent"]
        assert (slot["requests"], slot["total_tokens"]) == (1, tokens)
        assert slot["start"] % event["slot_seconds"] == 0
        assert time.time() - 60 < slot["start"] <= time.time()


def test_slow_subscriber_does_not_hold_up_requests_and_gets_the_newest_state(
    setup: Setup,
) -> None:
    with open_stream(setup) as slow, open_stream(setup) as fast:
        assert slow.next()[0] == "snapshot"
        # The slow subscriber reads nothing more while traffic flows.
        assert fast.next()[0] == "snapshot"
        for i in range(15):
            setup.chat(f"request {i}")
        fast.until(lambda e: _requests(e) == 15)

        event = slow.until(lambda e: _requests(e) == 15)
        assert event["subscribers"] == 2


def test_disconnected_subscriber_is_forgotten(setup: Setup) -> None:
    with open_stream(setup) as watcher:
        assert watcher.next()[1]["subscribers"] == 1
        with open_stream(setup) as leaving:
            assert leaving.next()[1]["subscribers"] == 2
            watcher.until(lambda e: e["subscribers"] == 2)
        # The server noticed the closed connection and dropped its subscription.
        watcher.until(lambda e: e["subscribers"] == 1)


def test_stream_refuses_anonymous_and_non_staff_clients(setup: Setup) -> None:
    url = f"{setup.server.base_url}/api/usage-stream"
    anonymous = httpx.get(url, timeout=5)
    assert anonymous.status_code == 401
    assert anonymous.headers["WWW-Authenticate"] == "Token"
    assert "Log in as staff" in anonymous.json()["detail"]

    user = User.objects.create_user("not-staff")
    token = Token.objects.create(user=user)
    refused = httpx.get(url, headers={"Authorization": f"Token {token.key}"}, timeout=5)
    assert refused.status_code == 403
    wrong = httpx.get(url, headers={"Authorization": "Token nope"}, timeout=5)
    assert wrong.status_code == 401

    post = httpx.post(url, headers={"Authorization": f"Token {setup.token}"}, timeout=5)
    assert post.status_code == 405


def test_stream_shows_requests_served_by_another_process(
    setup: Setup,
    nexus_server_factory: Callable[..., NexusServer],
    shared_redis_env: dict[str, str],
) -> None:
    # Both processes on one Redis: REDIS_URL's, or the embedded default's own.
    if shared_redis_env:
        setup = Setup(nexus_server_factory(**shared_redis_env), setup.key, setup.token)
    other = Setup(nexus_server_factory(**shared_redis_env), setup.key, setup.token)
    with open_stream(setup) as stream:
        assert stream.next()[0] == "snapshot"
        tokens = other.chat("served elsewhere")

        event = stream.until(lambda e: _requests(e) == 1)
        assert len(event["processes"]) == 2
        row = _series(event)
        assert row is not None
        assert row["total_tokens"] == tokens
        assert sum(slot["requests"] for slot in event["recent"]) == 1


def _ask_for(setup: Setup, model: str) -> int:
    """POST a chat request for `model` (JSON escapes what UTF-8 cannot carry)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    answer = httpx.post(
        f"{setup.server.base_url}/v1/chat/completions",
        content=body.encode(),
        headers={
            "Authorization": f"Bearer {setup.key}",
            "Content-Type": "application/json",
        },
        timeout=10,
    )
    return answer.status_code


def test_unknown_model_names_are_one_live_series(setup: Setup) -> None:
    """Red team (issue 27): every unknown name a client sent became a series
    of its own, kept for the life of the process (20,000 names: +12 MB)."""
    with open_stream(setup) as stream:
        assert stream.next()[0] == "snapshot"
        for n in range(30):
            assert _ask_for(setup, f"no-such-model-{n}") == 404
        setup.chat()

        event = stream.until(lambda e: _requests(e) == 1)
        models = {row["model"] for row in event["series"]}
        assert models <= {MODEL, "unknown"}
        unknown = [row for row in event["series"] if row["model"] == "unknown"]
        assert sum(row["requests"] for row in unknown) == 30


def test_a_lone_surrogate_model_name_leaves_publishing_working(
    request: pytest.FixtureRequest,
    nexus_server_factory: Callable[..., NexusServer],
    settings: Any,
) -> None:
    """Red team (issue 27): msgpack cannot encode "\\udfff" (valid JSON, no
    UTF-8): once it was a live series, the process never published again."""
    if "Redis" not in settings.CHANNEL_LAYERS["default"]["BACKEND"]:
        pytest.skip("the in-memory channel layer does not encode snapshots")
    setup: Setup = request.getfixturevalue("setup")
    other = Setup(nexus_server_factory(), setup.key, setup.token)
    assert _ask_for(other, "\udfff") == 404
    assert _ask_for(other, "a\ud800b") == 404
    with open_stream(setup) as stream:
        assert stream.next()[0] == "snapshot"
        tokens = other.chat("served elsewhere")

        event = stream.until(lambda e: _requests(e) == 1)
        assert len(event["processes"]) == 2
        row = _series(event)
        assert row is not None
        assert row["total_tokens"] == tokens
    assert not any("Could not publish" in line for line in other.server.log)
