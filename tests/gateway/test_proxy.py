"""The gateway through real processes: Daphne serving Nexus, mock backends, the SDK.

One Nexus server and two mock backends serve the whole module (their data is
committed once and removed at the end); tests change the mocks' behaviour via
their control API, and every mock is reset between tests.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import Alias, ChainStep, FallbackChain, RoutingPolicy
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey

MAX_BODY = 200_000


@dataclass
class Gateway:
    server: NexusServer
    a: MockBackendProcess  # llama3:8b (tools), mistral:7b
    b: MockBackendProcess  # llama3:8b, llava:7b (vision)
    key: str
    admin_token: str

    @property
    def v1(self) -> str:
        return f"{self.server.base_url}/v1"

    def sdk(self, **options: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.v1, api_key=self.key, max_retries=0, **options
        )

    def async_sdk(self) -> openai.AsyncOpenAI:
        # A long connect timeout: 200 connections at once can overflow the
        # listen backlog of a test server on a loaded machine (SYN retried).
        return openai.AsyncOpenAI(
            base_url=self.v1,
            api_key=self.key,
            max_retries=0,
            timeout=httpx.Timeout(120, connect=60),
        )

    def post(self, path: str, **kwargs: object) -> httpx.Response:
        headers = {"authorization": f"Bearer {self.key}", **kwargs.pop("headers", {})}
        return httpx.post(f"{self.v1}{path}", headers=headers, timeout=10, **kwargs)

    def in_flight(self, model: str) -> dict[str, int]:
        """The server's own in-flight count per backend, via the explain API."""
        record = httpx.post(
            f"{self.server.base_url}/api/v1/route/explain",
            json={"model": model},
            headers={"Authorization": f"Token {self.admin_token}"},
            timeout=5,
        ).json()
        return {c["backend"]: c["in_flight"] for c in record["candidates"]}


def _mock(process: MockBackendProcess, **knobs: object) -> dict:
    return httpx.post(f"{process.base_url}/_mock/config", json=knobs, timeout=5).json()


def _stats(process: MockBackendProcess) -> dict:
    return httpx.get(f"{process.base_url}/_mock/stats", timeout=5).json()


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, django_db_blocker) -> Iterator[Gateway]:
    a = start_mock_backend(
        "--models",
        "llama3:8b,mistral:7b,limited:1b",
        "--name",
        "mock-a",
        "--chunks",
        "4",
    )
    b = start_mock_backend(
        "--models", "llama3:8b,llava:7b", "--name", "mock-b", "--chunks", "4"
    )
    with django_db_blocker.unblock():
        backend_a = Backend.objects.create(
            name="mock-a",
            base_url=a.base_url,
            priority=1,
            status=HealthStatus.HEALTHY,
            api_key="sk-upstream-a",
        )
        backend_b = Backend.objects.create(
            name="mock-b",
            base_url=b.base_url,
            priority=2,
            status=HealthStatus.HEALTHY,
        )
        down = Backend.objects.create(
            name="down", base_url="http://127.0.0.1:9", status=HealthStatus.UNHEALTHY
        )
        BackendModel.objects.create(
            backend=backend_a,
            name="llama3:8b",
            supports_tools=True,
            context_length=8192,
        )
        BackendModel.objects.create(
            backend=backend_a,
            name="mistral:7b",
            context_length=32768,
            supports_vision=False,
        )
        BackendModel.objects.create(
            backend=backend_b, name="llama3:8b", context_length=8192
        )
        BackendModel.objects.create(
            backend=backend_b,
            name="llava:7b",
            supports_vision=True,
            context_length=4096,
        )
        BackendModel.objects.create(backend=down, name="down-model")
        # The same mock again, as a backend that takes one request at a time.
        limited = Backend.objects.create(
            name="mock-a-limited",
            base_url=a.base_url,
            max_concurrency=1,
            status=HealthStatus.HEALTHY,
        )
        BackendModel.objects.create(backend=limited, name="limited:1b")
        claude = Backend.objects.create(
            name="anthropic-1",
            base_url="https://api.anthropic.com",
            kind="anthropic",
            status=HealthStatus.HEALTHY,
        )
        BackendModel.objects.create(backend=claude, name="claude-3-haiku")
        Alias.objects.create(name="gpt-4", target="llava:7b")
        chain = FallbackChain.objects.create(model="claude-3-opus")
        ChainStep.objects.create(chain=chain, position=0, model="llama3:70b")
        ChainStep.objects.create(chain=chain, position=1, model="mistral:7b")
        policy = RoutingPolicy.load()
        policy.strategy = "round_robin"
        policy.max_retries = 2
        # 200 concurrent streams from one key wait in the admission queue (the
        # default band lets 5 through to two backends): room for all of them.
        policy.admission_flow_capacity = 1000
        policy.save()
        _, key = ApiKey.objects.create_key("proxy-tests")
        staff = get_user_model().objects.create_user(
            "proxy-ops", is_staff=True, is_superuser=True
        )
        token = Token.objects.create(user=staff).key
    # The breaker would rightly shun a mock that a test made fail; tests here
    # share the mocks, so it is off (tests/gateway/test_breaker_e2e.py covers it).
    # 200 concurrent streams of one key, too: over the default cap of 64.
    server = start_nexus_server(
        NEXUS_MAX_BODY_BYTES=str(MAX_BODY),
        NEXUS_BREAKER_FAILURES="1000000",
        NEXUS_KEY_MAX_STREAMS="1000",
    )
    try:
        yield Gateway(server, a, b, key, token)
    finally:
        server.stop()
        a.stop()
        b.stop()
        with django_db_blocker.unblock():
            # Empty, as a transactional test leaves it: the usage the server
            # recorded goes too, whichever test file a worker runs next.
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture(autouse=True)
def _reset_mocks(gateway: Gateway) -> Iterator[None]:
    yield
    for process in (gateway.a, gateway.b):
        process.process.send_signal(signal.SIGUSR1)  # stop refusing, if it was
        deadline = time.monotonic() + 5
        while True:
            try:
                httpx.post(f"{process.base_url}/_mock/reset", timeout=5)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "mock did not come back"
                time.sleep(0.05)


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


# --- the happy paths ---------------------------------------------------------


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_the_gateway_serves_committed_configuration(gateway: Gateway) -> None:
    assert set(Backend.objects.values_list("name", flat=True)) == {
        "mock-a",
        "mock-b",
        "down",
        "mock-a-limited",
        "anthropic-1",
    }


def test_chat_is_answered_by_a_backend_with_nexus_headers(gateway: Gateway) -> None:
    raw = gateway.sdk().chat.completions.with_raw_response.create(
        model="llama3:8b",
        messages=chat("hello there"),
        extra_headers={"X-Request-ID": "req-123"},
    )
    completion = raw.parse()
    backend = raw.headers["x-nexus-backend"]
    assert backend in {"mock-a", "mock-b"}
    assert raw.headers["x-nexus-model"] == "llama3:8b"
    assert raw.headers["x-request-id"] == "req-123"
    assert completion.choices[0].message.content == (
        f"[{backend}/llama3:8b] echo: hello there"
    )
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    upstream = next(
        r
        for p in (gateway.a, gateway.b)
        for r in _stats(p)["last_requests"]
        if r["path"] == "/v1/chat/completions"
    )
    # The client's Nexus key never travels upstream; the backend's own key does.
    assert gateway.key not in str(upstream["headers"])
    assert upstream["headers"].get("x-request-id") == "req-123"


def test_backend_key_is_sent_upstream(gateway: Gateway) -> None:
    gateway.sdk().chat.completions.create(model="mistral:7b", messages=chat("hi"))
    (request,) = [
        r
        for r in _stats(gateway.a)["last_requests"]
        if r["path"] == "/v1/chat/completions"
    ]
    assert request["headers"]["authorization"] == "Bearer sk-upstream-a"


def test_round_robin_spreads_requests_evenly(gateway: Gateway) -> None:
    sdk = gateway.sdk()
    served = [
        sdk.chat.completions.with_raw_response.create(
            model="llama3:8b", messages=chat(str(i))
        ).headers["x-nexus-backend"]
        for i in range(6)
    ]
    assert sorted(served) == ["mock-a"] * 3 + ["mock-b"] * 3


def test_stream_arrives_in_chunks_without_the_usage_chunk_unless_asked(
    gateway: Gateway,
) -> None:
    sdk = gateway.sdk()
    chunks = list(
        sdk.chat.completions.create(
            model="mistral:7b", messages=chat("stream me"), stream=True
        )
    )
    assert all(chunk.choices for chunk in chunks)  # no usage-only chunk
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "[mock-a/mistral:7b] echo: stream me"
    assert len(chunks) == 4

    with_usage = list(
        sdk.chat.completions.create(
            model="mistral:7b",
            messages=chat("stream me"),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert not with_usage[-1].choices
    assert with_usage[-1].usage.total_tokens > 0


def test_stream_headers(gateway: Gateway) -> None:
    with httpx.stream(
        "POST",
        f"{gateway.v1}/chat/completions",
        json={"model": "mistral:7b", "messages": chat("x"), "stream": True},
        headers={"authorization": f"Bearer {gateway.key}"},
        timeout=10,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        body = response.read()
    assert body.rstrip().endswith(b"data: [DONE]")


def test_completions_and_embeddings(gateway: Gateway) -> None:
    sdk = gateway.sdk()
    completion = sdk.completions.create(model="mistral:7b", prompt="once upon")
    assert completion.choices[0].text == "[mock-a/mistral:7b] echo: once upon"
    streamed = "".join(
        c.choices[0].text
        for c in sdk.completions.create(
            model="mistral:7b", prompt="once upon", stream=True
        )
    )
    assert streamed == completion.choices[0].text
    embedding = sdk.embeddings.create(model="mistral:7b", input=["a", "b"])
    assert len(embedding.data) == 2 and len(embedding.data[0].embedding) == 8


def test_models_list_has_served_models_and_aliases(gateway: Gateway) -> None:
    models = {m.id: m.owned_by for m in gateway.sdk().models.list().data}
    assert models == {
        "llama3:8b": "mock-a,mock-b",
        "mistral:7b": "mock-a",
        "llava:7b": "mock-b",
        "limited:1b": "mock-a-limited",
        "claude-3-haiku": "anthropic-1",
        "gpt-4": "alias:llava:7b",
        # Two backends serve llama3:8b: its multiple-opinions name is listed.
        "moe-llama3:8b": "ensemble:llama3:8b",
    }  # down-model's only backend is unhealthy
    assert gateway.sdk().models.retrieve("gpt-4").owned_by == "alias:llava:7b"
    with pytest.raises(openai.NotFoundError):
        gateway.sdk().models.retrieve("down-model")


# --- routing by capability, alias and fallback ---------------------------------


def test_vision_and_tools_requests_land_on_capable_backends(gateway: Gateway) -> None:
    sdk = gateway.sdk()
    image = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,AAAA"},
                },
            ],
        }
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for _ in range(3):
        seen = sdk.chat.completions.with_raw_response.create(
            model="llava:7b", messages=image
        )
        assert seen.headers["x-nexus-backend"] == "mock-b"
        tooled = sdk.chat.completions.with_raw_response.create(
            model="llama3:8b", messages=chat("call"), tools=tools
        )
        assert tooled.headers["x-nexus-backend"] == "mock-a"


def test_alias_and_fallback_show_the_served_model(gateway: Gateway) -> None:
    sdk = gateway.sdk()
    aliased = sdk.chat.completions.with_raw_response.create(
        model="gpt-4", messages=chat("hi")
    )
    assert aliased.headers["x-nexus-model"] == "llava:7b"
    assert "[mock-b/llava:7b]" in aliased.parse().choices[0].message.content
    fallen = sdk.chat.completions.with_raw_response.create(
        model="claude-3-opus", messages=chat("hi")
    )
    assert fallen.headers["x-nexus-model"] == "mistral:7b"


# --- errors ------------------------------------------------------------------


def test_router_errors_raise_the_sdks_matching_exceptions(gateway: Gateway) -> None:
    sdk = gateway.sdk()
    with pytest.raises(openai.NotFoundError, match="Model 'gpt-5' not found"):
        sdk.chat.completions.create(model="gpt-5", messages=chat("x"))
    image = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
        }
    ]
    with pytest.raises(openai.BadRequestError, match="vision"):
        sdk.chat.completions.create(model="mistral:7b", messages=image)
    with pytest.raises(openai.APIStatusError) as unavailable:
        sdk.chat.completions.create(model="down-model", messages=chat("x"))
    assert unavailable.value.status_code == 503
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=gateway.v1, api_key="nx-wrong", max_retries=0
        ).models.list()
    missing = httpx.get(f"{gateway.v1}/models")
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model"),
        (
            b'{"model": "", "messages": [{"role": "user", "content": "x"}]}',
            400,
            "model",
        ),
        (b'{"model": 3, "messages": [{"role": "user", "content": "x"}]}', 400, "model"),
        (b'{"model": "llama3:8b", "messages": "hi"}', 400, "messages"),
        (b'{"model": "llama3:8b", "messages": ["hi"]}', 400, "messages"),
        (b'{"model": "llama3:8b", "messages": [], "stream": "yes"}', 400, None),
    ],
)
def test_bad_input_gets_an_openai_shaped_4xx(
    gateway: Gateway, body: bytes, status: int, param: str | None
) -> None:
    response = gateway.post(
        "/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param


def test_oversized_body_wrong_method_and_unknown_path(gateway: Gateway) -> None:
    big = gateway.post(
        "/chat/completions",
        json={"model": "llama3:8b", "messages": chat("x" * (MAX_BODY + 10))},
    )
    assert big.status_code == 413
    assert big.json()["error"]["code"] == "request_too_large"
    wrong = httpx.get(
        f"{gateway.v1}/chat/completions",
        headers={"authorization": f"Bearer {gateway.key}"},
    )
    assert wrong.status_code == 405 and "error" in wrong.json()
    unknown = gateway.post("/nothing-here", json={})
    assert unknown.status_code == 404 and "error" in unknown.json()


def test_backend_4xx_is_passed_through_not_retried(gateway: Gateway) -> None:
    _mock(gateway.a, fail_status=429, error_rate=1)
    with pytest.raises(openai.RateLimitError):
        gateway.sdk().chat.completions.create(model="mistral:7b", messages=chat("x"))
    assert _stats(gateway.a)["requests"].get("/v1/chat/completions") == 1


# --- retries, mid-stream failure, disconnects, concurrency -----------------------


@pytest.mark.parametrize(
    "failure",
    [
        {"fail_status": 503, "error_rate": 1},
        {"refuse": True},
    ],
)
def test_a_failing_backend_is_retried_on_the_other(
    gateway: Gateway, failure: dict
) -> None:
    _mock(gateway.a, **failure)
    sdk = gateway.sdk()
    for i in range(6):
        raw = sdk.chat.completions.with_raw_response.create(
            model="llama3:8b", messages=chat(f"n{i}")
        )
        assert raw.headers["x-nexus-backend"] == "mock-b"
        assert raw.parse().choices[0].message.content.endswith(f"n{i}")
    if "fail_status" in failure:
        # Each request tried mock-a at most once.
        assert _stats(gateway.a)["requests"]["/v1/chat/completions"] <= 6


def test_failure_of_the_only_backend_is_reported(gateway: Gateway) -> None:
    _mock(gateway.a, fail_status=503, error_rate=1)
    with pytest.raises(openai.InternalServerError) as failed:
        gateway.sdk().chat.completions.create(model="mistral:7b", messages=chat("x"))
    assert failed.value.status_code == 503


def test_backend_dying_mid_stream_ends_with_an_error_event(gateway: Gateway) -> None:
    _mock(gateway.a, drop_after_chunks=2)
    stream = gateway.sdk().chat.completions.create(
        model="mistral:7b", messages=chat("a b c d e f"), stream=True
    )
    received = []
    with pytest.raises(openai.APIError, match="mid-stream"):
        received.extend(stream)
    assert len(received) == 2
    _mock(gateway.a, drop_after_chunks=None)
    ok = gateway.sdk().chat.completions.create(model="mistral:7b", messages=chat("x"))
    assert ok.choices[0].message.content.endswith("x")


def test_client_disconnect_closes_upstream_and_frees_the_slot(
    gateway: Gateway,
) -> None:
    _mock(gateway.a, chunks=50, chunk_delay_ms=100)

    async def abort_one(client: httpx.AsyncClient) -> None:
        async with client.stream(
            "POST",
            f"{gateway.v1}/chat/completions",
            json={"model": "mistral:7b", "messages": chat("long"), "stream": True},
            headers={"authorization": f"Bearer {gateway.key}"},
        ) as response:
            async for _ in response.aiter_lines():
                break  # first bytes arrived: hang up

    async def abort_many() -> None:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            await asyncio.gather(*(abort_one(client) for _ in range(200)))

    asyncio.run(abort_many())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = _stats(gateway.a)
        if stats["in_flight"] == 0 and gateway.in_flight("mistral:7b") == {"mock-a": 0}:
            break
        time.sleep(0.05)
    assert stats["in_flight"] == 0
    assert stats["client_disconnects"] >= 200
    assert gateway.in_flight("mistral:7b") == {"mock-a": 0}


def test_upstream_is_closed_within_a_second_of_a_disconnect(gateway: Gateway) -> None:
    _mock(gateway.a, chunks=100, chunk_delay_ms=100)
    with httpx.stream(
        "POST",
        f"{gateway.v1}/chat/completions",
        json={"model": "mistral:7b", "messages": chat("long"), "stream": True},
        headers={"authorization": f"Bearer {gateway.key}"},
        timeout=10,
    ) as response:
        next(response.iter_lines())
    hung_up = time.monotonic()
    while _stats(gateway.a)["client_disconnects"] < 1:
        assert time.monotonic() - hung_up < 1.0, "upstream still open after 1 s"
        time.sleep(0.02)


def test_two_hundred_concurrent_streams_are_not_mixed_up(gateway: Gateway) -> None:
    _mock(gateway.a, chunk_delay_ms=5)
    _mock(gateway.b, chunk_delay_ms=5)

    async def one(sdk: openai.AsyncOpenAI, i: int) -> tuple[int, str, str]:
        stream = await sdk.chat.completions.with_raw_response.create(
            model="llama3:8b", messages=chat(f"request number {i}"), stream=True
        )
        backend = stream.headers["x-nexus-backend"]
        text = ""
        async for chunk in stream.parse():
            text += chunk.choices[0].delta.content or ""
        return i, backend, text

    async def run() -> list[tuple[int, str, str]]:
        sdk = gateway.async_sdk()
        try:
            return await asyncio.gather(*(one(sdk, i) for i in range(200)))
        finally:
            await sdk.close()

    results = asyncio.run(run())
    for i, backend, text in results:
        assert text == f"[{backend}/llama3:8b] echo: request number {i}"
    assert {backend for _, backend, _ in results} == {"mock-a", "mock-b"}


def test_a_full_backend_is_not_sent_more_than_its_max_concurrency(
    gateway: Gateway,
) -> None:
    # Admission control (on by default) gives a backend with max_concurrency
    # 1 a band of exactly 1: the other three wait in Nexus's queue and are
    # sent one at a time, instead of the 503 "at its concurrency limit" the
    # proxy's own guard would answer.
    _mock(gateway.a, latency_ms=400)
    waited_before = _dequeued(gateway)
    if settings.REDIS_URL:
        # In production mode the backend's slot is a lease in Redis. A Redis
        # without the limiter's scripts (new, or restarted) answered the
        # first release "NOSCRIPT", and the release, sent again, came after
        # the next request's acquire: that request got 503 backends_busy.
        client = redis.Redis.from_url(settings.REDIS_URL)
        client.script_flush()
        client.close()

    async def one(sdk: openai.AsyncOpenAI) -> tuple[int, str]:
        try:
            await sdk.chat.completions.create(model="limited:1b", messages=chat("x"))
        except openai.APIStatusError as error:
            return error.status_code, error.message
        return 200, ""

    async def run() -> list[tuple[int, str]]:
        sdk = gateway.async_sdk()
        try:
            return await asyncio.gather(*(one(sdk) for _ in range(4)))
        finally:
            await sdk.close()

    answers = sorted(asyncio.run(run()))
    assert answers == [(200, "")] * 4
    assert _stats(gateway.a)["requests"]["/v1/chat/completions"] == 4
    assert _dequeued(gateway) - waited_before == 3


def _dequeued(gateway: Gateway) -> float:
    text = httpx.get(f"{gateway.server.base_url}/metrics", timeout=5).text
    found = re.findall(
        r"^nexus_admission_dequeue_successes_total ([0-9.e+]+)$", text, re.MULTILINE
    )
    return float(found[0]) if found else 0.0
    assert gateway.in_flight("limited:1b") == {"mock-a-limited": 0}


def test_embeddings_for_a_model_only_anthropic_serves_get_a_clear_501(
    gateway: Gateway,
) -> None:
    # Chat requests to Anthropic backends are translated (tests/routing/
    # test_messages.py); Anthropic has no embeddings or legacy completions.
    with pytest.raises(openai.APIStatusError) as raised:
        gateway.sdk().embeddings.create(model="claude-3-haiku", input="x")
    assert raised.value.status_code == 501
    assert "serves chat completions only" in raised.value.message


def test_retried_5xx_replies_do_not_leak_upstream_connections(
    gateway: Gateway,
) -> None:
    _mock(gateway.a, fail_status=503, error_rate=1)
    # A pool of two connections: a leaked one per retry would exhaust it fast.
    server = start_nexus_server(
        NEXUS_UPSTREAM_MAX_CONNECTIONS="2",
        NEXUS_UPSTREAM_CONNECT_TIMEOUT="1",
        NEXUS_BREAKER_FAILURES="1000000",
    )
    try:
        sdk = openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key=gateway.key, max_retries=0
        )
        for i in range(12):
            reply = sdk.chat.completions.with_raw_response.create(
                model="llama3:8b", messages=chat(f"n{i}")
            )
            assert reply.headers["x-nexus-backend"] == "mock-b"
    finally:
        server.stop()
