"""The proxy's hot path, in process: no ORM query on a full streamed request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.process import Gateway, GatewayConfig
from gateway.proxy import ProxyApp
from tests.conftest import MockBackendProcess, mock_stats
from tests.factories import BackendFactory, BackendModelFactory
from usage.buffer import UsageEvent, UsageOpen
from usage.models import ApiKey


def make_gateway() -> Gateway:
    """A gateway as a serving process has one, its state loaded at start-up."""
    gateway = Gateway(GatewayConfig(usage_transport="database"))
    gateway.snapshots.load()
    return gateway


async def serve(
    gateway: Gateway, requests: int = 1, **post: object
) -> list[httpx.Response]:
    """Send requests through the proxy in process, then stop the gateway."""
    transport = httpx.ASGITransport(app=ProxyApp(gateway))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://nexus") as c:
            return [
                await c.post("/v1/chat/completions", **post) for _ in range(requests)
            ]
    finally:
        # Stopping would write the buffer to the database: keep it to inspect.
        events = gateway.buffer.drain()
        await gateway.stop()
        gateway.buffer.requeue(events)


@pytest.mark.django_db
def test_a_streamed_request_makes_no_database_queries(
    mock_backend: MockBackendProcess, django_assert_num_queries
) -> None:
    backend = BackendFactory(name="mock-a", base_url=mock_backend.base_url)
    BackendModelFactory(backend=backend, name="llama3:8b")
    _, key = ApiKey.objects.create_key("hot-path")
    gateway = make_gateway()  # at start-up, outside the request

    with django_assert_num_queries(0):
        (response,) = asyncio.run(
            serve(
                gateway,
                json={
                    "model": "llama3:8b",
                    "messages": [{"role": "user", "content": "no queries please"}],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
                headers={"authorization": f"Bearer {key}"},
            )
        )
    status, text = response.status_code, response.text

    assert status == 200
    assert text.rstrip().endswith("data: [DONE]")
    chunks = [
        json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")
    ]
    content = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert content == "[mock-a/llama3:8b] echo: no queries please"
    # Opened when the pipeline took it, settled under the same id when it ended.
    opened, event = gateway.buffer.drain()
    assert isinstance(opened, UsageOpen) and isinstance(event, UsageEvent)
    assert opened.event_id == event.event_id and opened.streamed
    assert event.backend == "mock-a" and event.streamed and not event.estimated
    assert event.prompt_tokens > 0 and event.completion_tokens > 0
    assert event.total_tokens == event.prompt_tokens + event.completion_tokens
    assert event.api_key_prefix == key[:11]


@pytest.mark.django_db
def test_live_counters_follow_requests(mock_backend: MockBackendProcess) -> None:
    backend = BackendFactory(name="mock-live", base_url=mock_backend.base_url)
    BackendModelFactory(backend=backend, name="mistral:7b")
    _, key = ApiKey.objects.create_key("live")
    gateway = make_gateway()
    live_usage = gateway.live_usage

    responses = asyncio.run(
        serve(
            gateway,
            requests=2,
            json={
                "model": "mistral:7b",
                "messages": [{"role": "user", "content": "hi"}],
            },
            headers={"authorization": f"Bearer {key}"},
        )
    )

    assert [r.status_code for r in responses] == [200, 200]
    after = {(s["backend"], s["model"]): s for s in live_usage.snapshot()["series"]}[
        ("mock-live", "mistral:7b")
    ]
    assert after["requests"] == 2
    assert after["total_tokens"] > 0
    assert after["in_flight"] == 0
    assert gateway.stats.in_flight("mock-live") == 0
    assert live_usage.snapshot()["latencies_ms"]["mistral:7b"]


@pytest.mark.django_db
def test_a_cached_miss_and_hit_make_no_database_queries(
    mock_backend: MockBackendProcess, django_assert_num_queries
) -> None:
    from routing.models import RoutingPolicy

    backend = BackendFactory(name="mock-cache", base_url=mock_backend.base_url)
    BackendModelFactory(backend=backend, name="llama3:8b")
    _, key = ApiKey.objects.create_key("hot-path-cache")
    policy = RoutingPolicy.load()
    policy.cache_enabled = True
    policy.save()
    gateway = make_gateway()  # its cache in memory: no Redis URL given

    with django_assert_num_queries(0):
        miss, hit = asyncio.run(
            serve(
                gateway,
                requests=2,
                json={
                    "model": "llama3:8b",
                    "messages": [{"role": "user", "content": "cached, no queries"}],
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
                headers={"authorization": f"Bearer {key}"},
            )
        )
    assert miss.headers["x-nexus-cache"] == "miss"
    assert hit.headers["x-nexus-cache"] == "hit"
    assert hit.text.rstrip().endswith("data: [DONE]")
    events = [e for e in gateway.buffer.drain() if isinstance(e, UsageEvent)]
    assert [e.cache_hit for e in events] == [False, True]
    assert events[1].total_tokens == events[0].total_tokens > 0


@pytest.mark.django_db
def test_with_traces_off_the_proxy_makes_no_tracing_call(
    mock_backend: MockBackendProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.proxy import traces

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tracing call with traces off")

    for name in ("start", "note_request", "finish", "start_attempt", "route"):
        monkeypatch.setattr(traces, name, refuse)
    backend = BackendFactory(name="mock-untraced", base_url=mock_backend.base_url)
    BackendModelFactory(backend=backend, name="llama3:8b")
    _, key = ApiKey.objects.create_key("untraced")
    gateway = make_gateway()
    assert gateway.tracing is None  # no OTEL_* in the tests' environment

    (response,) = asyncio.run(
        serve(
            gateway,
            json={"model": "llama3:8b", "messages": [{"role": "user", "content": "x"}]},
            headers={"authorization": f"Bearer {key}"},
        )
    )
    assert response.status_code == 200
    assert "traceparent" not in mock_stats(mock_backend)["last_requests"][-1]["headers"]
