"""The proxy's hot path, in process: no ORM query on a full streamed request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from routing import live
from routing.proxy import ProxyApp
from tests.conftest import MockBackendProcess
from tests.factories import BackendFactory, BackendModelFactory
from usage.buffer import buffer
from usage.models import ApiKey


@pytest.mark.django_db
def test_a_streamed_request_makes_no_database_queries(
    mock_backend: MockBackendProcess, django_assert_num_queries
) -> None:
    backend = BackendFactory(name="mock-a", base_url=mock_backend.base_url)
    BackendModelFactory(backend=backend, name="llama3:8b")
    _, key = ApiKey.objects.create_key("hot-path")
    live.snapshots.load()  # at start-up, outside the request
    buffer.drain()

    async def stream_once() -> tuple[int, str]:
        transport = httpx.ASGITransport(app=ProxyApp())
        async with httpx.AsyncClient(transport=transport, base_url="http://nexus") as c:
            response = await c.post(
                "/v1/chat/completions",
                json={
                    "model": "llama3:8b",
                    "messages": [{"role": "user", "content": "no queries please"}],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
                headers={"authorization": f"Bearer {key}"},
            )
            return response.status_code, response.text

    with django_assert_num_queries(0):
        status, text = asyncio.run(stream_once())

    assert status == 200
    assert text.rstrip().endswith("data: [DONE]")
    chunks = [
        json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")
    ]
    content = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert content == "[mock-a/llama3:8b] echo: no queries please"
    (event,) = buffer.drain()
    assert event.backend == "mock-a" and event.streamed and not event.estimated
    assert event.prompt_tokens > 0 and event.completion_tokens > 0
    assert event.total_tokens == event.prompt_tokens + event.completion_tokens
    assert event.api_key_prefix == key[:11]


@pytest.mark.django_db
def test_live_counters_follow_requests(mock_backend: MockBackendProcess) -> None:
    from usage.live import live_usage

    backend = BackendFactory(name="mock-live", base_url=mock_backend.base_url)
    BackendModelFactory(backend=backend, name="mistral:7b")
    _, key = ApiKey.objects.create_key("live")
    live.snapshots.load()
    before = {
        (s["backend"], s["model"]): s for s in live_usage.snapshot()["series"]
    }.get(("mock-live", "mistral:7b"), {"requests": 0, "total_tokens": 0})

    async def two_requests() -> None:
        transport = httpx.ASGITransport(app=ProxyApp())
        async with httpx.AsyncClient(transport=transport, base_url="http://nexus") as c:
            for _ in range(2):
                response = await c.post(
                    "/v1/chat/completions",
                    json={
                        "model": "mistral:7b",
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                    headers={"authorization": f"Bearer {key}"},
                )
                assert response.status_code == 200

    asyncio.run(two_requests())
    after = {(s["backend"], s["model"]): s for s in live_usage.snapshot()["series"]}[
        ("mock-live", "mistral:7b")
    ]
    assert after["requests"] == before["requests"] + 2
    assert after["total_tokens"] > before["total_tokens"]
    assert after["in_flight"] == 0
    assert live_usage.snapshot()["latencies_ms"]["mistral:7b"]
