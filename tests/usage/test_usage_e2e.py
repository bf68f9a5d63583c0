"""Usage through the whole pipeline: SDK -> Nexus (Daphne) -> mock -> database.

The tokens the backend reported, stream and not, are in the database exactly
once after the serving process flushed them and a rollup ran; a graceful stop
flushes what the process still held.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from django.conf import settings

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import MockBackendProcess, NexusServer
from usage.models import ApiKey, TokenUsage, UsageRecord
from usage.rollup import roll_up_usage
from usage.stream import clear_usage_stream, drain_usage_stream

pytestmark = pytest.mark.django_db(transaction=True)
SHIPS_TO_REDIS = settings.NEXUS_USAGE_TRANSPORT == "redis"


def _setup(mock: MockBackendProcess) -> str:
    if SHIPS_TO_REDIS:
        clear_usage_stream()  # events other tests' servers left behind
    backend = Backend.objects.create(
        name="mock-usage", base_url=mock.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name="llama3:8b")
    _, key = ApiKey.objects.create_key("usage-e2e")
    return key


def _wait_for_records(count: int, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while (SHIPS_TO_REDIS and drain_usage_stream()) or (
        UsageRecord.objects.count() < count
    ):
        assert time.monotonic() < deadline, UsageRecord.objects.count()
        time.sleep(0.1)


def test_reported_tokens_reach_the_aggregates_exactly_once(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    key = _setup(mock_backend_factory("--models", "llama3:8b", "--name", "m"))
    server = nexus_server_factory()
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    expected = 0
    for i in range(3):
        reply = sdk.chat.completions.create(
            model="llama3:8b", messages=[{"role": "user", "content": f"one two {i}"}]
        )
        expected += reply.usage.total_tokens
    for i in range(2):
        chunks = list(
            sdk.chat.completions.create(
                model="llama3:8b",
                messages=[{"role": "user", "content": f"three {i}"}],
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        expected += chunks[-1].usage.total_tokens
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )

    _wait_for_records(6)
    roll_up_usage()
    roll_up_usage()  # a second run adds nothing

    (row,) = TokenUsage.objects.filter(backend="mock-usage")
    assert row.model == "llama3:8b"
    assert row.api_key_prefix == key[:11]
    assert row.requests == 5 and row.errors == 0
    assert row.total_tokens == expected
    assert row.estimated_requests == 0
    failed = TokenUsage.objects.get(backend="", model="nope")
    assert failed.requests == 1 and failed.errors == 1
    used = ApiKey.objects.get(prefix=key[:11]).last_used_at
    assert used == UsageRecord.objects.latest("created_at").created_at


def test_a_graceful_stop_flushes_what_the_process_still_held(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    key = _setup(mock_backend_factory("--models", "llama3:8b", "--name", "m"))
    # Intervals far beyond the test: only the shutdown can hand usage on.
    server = nexus_server_factory(
        NEXUS_USAGE_FLUSH_INTERVAL="3600", NEXUS_USAGE_SHIP_INTERVAL="3600"
    )
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    for i in range(4):
        sdk.chat.completions.create(
            model="llama3:8b", messages=[{"role": "user", "content": str(i)}]
        )
    time.sleep(0.5)
    assert not SHIPS_TO_REDIS or drain_usage_stream() == 0
    assert UsageRecord.objects.count() == 0
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=20) == 0
    if SHIPS_TO_REDIS:
        drain_usage_stream()
    assert UsageRecord.objects.count() == 4


@pytest.mark.skipif(
    not SHIPS_TO_REDIS, reason="the embedded default writes usage once a second"
)
def test_a_killed_process_loses_no_usage_it_answered_a_moment_before(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    key = _setup(mock_backend_factory("--models", "llama3:8b", "--name", "m"))
    server = nexus_server_factory()
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    for i in range(30):
        sdk.chat.completions.create(
            model="llama3:8b", messages=[{"role": "user", "content": str(i)}]
        )
    time.sleep(0.3)  # a few shipping intervals, far less than a second
    server.process.kill()
    server.process.wait(timeout=10)

    drain_usage_stream()
    assert UsageRecord.objects.filter(backend="mock-usage").count() == 30


def test_requests_refused_before_any_backend_count_with_zero_tokens(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    """Issue 12, items 6 and 19: refusals are requests and errors, 0 tokens."""
    key = _setup(mock_backend_factory("--models", "llama3:8b", "--name", "m"))
    text_only = Backend.objects.create(
        name="text-only-backend", base_url="http://127.0.0.1:9", status="healthy"
    )
    BackendModel.objects.create(
        backend=text_only, name="text-only", supports_vision=False
    )
    server = nexus_server_factory(NEXUS_MAX_BODY_BYTES="20000")
    auth = {"authorization": f"Bearer {key}"}
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]

    def chat(model: str, content: object = "x") -> dict:
        return {"model": model, "messages": [{"role": "user", "content": content}]}

    refusals = [
        # A vision request to a model whose only backend says no.
        (chat("text-only", image), auth, 400),
        ({"model": "llama3:8b", "messages": "hi"}, auth, 400),
        (chat("llama3:8b"), {}, 401),
        (chat("nope"), auth, 404),
        # PostgreSQL text cannot hold NUL: still counted (item 19).
        (chat("bad\x00name\ud800"), auth, 404),
        (chat("llama3:8b", "x" * 30000), auth, 413),
    ]
    for body, headers, status in refusals:
        answer = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            # JSON escapes: the NUL and the lone surrogate arrive as \u escapes.
            content=json.dumps(body).encode(),
            headers={"content-type": "application/json", **headers},
            timeout=10,
        )
        assert answer.status_code == status, answer.text

    _wait_for_records(len(refusals))
    rows = list(UsageRecord.objects.all())
    assert sorted(row.status for row in rows) == sorted(s for _, _, s in refusals)
    for row in rows:
        assert row.is_error
        assert (row.prompt_tokens, row.completion_tokens, row.total_tokens) == (
            0,
            0,
            0,
        )
        assert row.backend == ""
    assert UsageRecord.objects.filter(requested_model="bad\ufffdname\ufffd").exists()
    roll_up_usage()
    totals = TokenUsage.objects.filter(backend="")
    assert sum(t.requests for t in totals) == len(refusals)
    assert sum(t.errors for t in totals) == len(refusals)
    assert sum(t.total_tokens for t in totals) == 0
