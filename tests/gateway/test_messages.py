"""Anthropic's Messages API through Nexus, with the official SDKs and real processes.

One Nexus (Daphne) serves the module with two mock backends: ``mock-o`` speaks
OpenAI's API (so Anthropic clients are translated), ``mock-c`` is of kind
``anthropic`` (Anthropic clients are passed through, OpenAI clients
translated). The mocks are reset between tests.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
from django.conf import settings
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import RoutingPolicy
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

UPSTREAM_KEY = "sk-ant-upstream"
WEATHER = {
    "name": "weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n-not-really").decode()


@dataclass
class Gateway:
    server: NexusServer
    o: MockBackendProcess  # kind openai: llama3:8b (tools), llava:7b (vision)
    c: MockBackendProcess  # kind anthropic: claude-x
    key: str
    usage_key: str

    def client(self, **options: object) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.server.base_url,
            api_key=options.pop("api_key", self.key),
            max_retries=0,
            **options,
        )

    def async_client(self) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(
            base_url=self.server.base_url, api_key=self.key, max_retries=0
        )

    def openai(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.server.base_url}/v1",
            api_key=key or self.key,
            max_retries=0,
        )


def _mock(process: MockBackendProcess, **knobs: object) -> dict:
    return httpx.post(f"{process.base_url}/_mock/config", json=knobs, timeout=5).json()


def _last_request(process: MockBackendProcess) -> dict:
    stats = httpx.get(f"{process.base_url}/_mock/stats", timeout=5).json()
    return stats["last_requests"][-1]


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, django_db_blocker) -> Iterator[Gateway]:
    with contextlib.ExitStack() as cleanup:
        yield _start_gateway(cleanup, django_db_blocker)


def _start_gateway(cleanup: contextlib.ExitStack, django_db_blocker) -> Gateway:
    """Start the mocks and Nexus on committed rows; ``cleanup`` undoes it all."""
    o = start_mock_backend(
        "--models", "llama3:8b,llava:7b", "--name", "mock-o", "--chunks", "4"
    )
    cleanup.callback(o.stop)
    c = start_mock_backend(
        "--models",
        "claude-x",
        "--name",
        "mock-c",
        "--kind",
        "anthropic",
        "--api-key",
        UPSTREAM_KEY,
        "--chunks",
        "4",
    )
    cleanup.callback(c.stop)

    def flush() -> None:
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)

    cleanup.callback(flush)
    with django_db_blocker.unblock():
        if settings.NEXUS_USAGE_TRANSPORT == "redis":
            clear_usage_stream()
        backend_o = Backend.objects.create(
            name="mock-o", base_url=o.base_url, status=HealthStatus.HEALTHY
        )
        BackendModel.objects.create(
            backend=backend_o,
            name="llama3:8b",
            supports_tools=True,
            supports_vision=False,
        )
        BackendModel.objects.create(
            backend=backend_o, name="llava:7b", supports_vision=True
        )
        backend_c = Backend.objects.create(
            name="mock-c",
            base_url=c.base_url,
            kind="anthropic",
            api_key=UPSTREAM_KEY,
            status=HealthStatus.HEALTHY,
        )
        BackendModel.objects.create(
            backend=backend_c, name="claude-x", supports_tools=True
        )
        policy = RoutingPolicy.load()
        policy.max_retries = 0
        policy.save()
        _, key = ApiKey.objects.create_key("messages-tests")
        _, usage_key = ApiKey.objects.create_key("messages-usage")
    server = start_nexus_server(NEXUS_BREAKER_FAILURES="1000000")
    cleanup.callback(server.stop)
    return Gateway(server, o, c, key, usage_key)


@pytest.fixture(autouse=True)
def _reset_mocks(gateway: Gateway) -> Iterator[None]:
    yield
    for process in (gateway.o, gateway.c):
        httpx.post(f"{process.base_url}/_mock/reset", timeout=5)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_the_backends_of_both_kinds_are_configured(gateway: Gateway) -> None:
    kinds = dict(Backend.objects.values_list("name", "kind"))
    assert kinds == {"mock-o": "openai", "mock-c": "anthropic"}


# --- Anthropic clients, translated for an OpenAI backend ----------------------


def test_the_sdk_gets_a_message_from_an_openai_backend(gateway: Gateway) -> None:
    raw = gateway.client().messages.with_raw_response.create(
        model="llama3:8b",
        max_tokens=100,
        system="Be brief.",
        messages=user("Hello there"),
    )
    message = raw.parse()
    assert raw.headers["x-nexus-backend"] == "mock-o"
    assert message.type == "message" and message.role == "assistant"
    assert message.model == "llama3:8b"
    assert [block.text for block in message.content] == [
        "[mock-o/llama3:8b] echo: Hello there"
    ]
    assert message.stop_reason == "end_turn"
    # The mock counts words: 2 system + 2 user in, 4 out.
    assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 4)
    sent = json.loads(_last_request(gateway.o)["body"])
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."}
    assert sent["max_tokens"] == 100


def test_max_tokens_stops_with_the_anthropic_reason(gateway: Gateway) -> None:
    message = gateway.client().messages.create(
        model="llama3:8b", max_tokens=2, messages=user("one two three")
    )
    assert message.content[0].text == "[mock-o/llama3:8b] echo:"
    assert message.stop_reason == "max_tokens"


def test_the_async_sdk_and_concurrent_requests(gateway: Gateway) -> None:
    async def run() -> list[str]:
        client = gateway.async_client()
        try:
            replies = await asyncio.gather(
                *(
                    client.messages.create(
                        model="llama3:8b", max_tokens=50, messages=user(f"n{i}")
                    )
                    for i in range(20)
                )
            )
        finally:
            await client.close()
        return [reply.content[0].text for reply in replies]

    assert asyncio.run(run()) == [f"[mock-o/llama3:8b] echo: n{i}" for i in range(20)]


def test_a_stream_has_every_anthropic_event_and_the_right_usage(
    gateway: Gateway,
) -> None:
    with gateway.client().messages.stream(
        model="llama3:8b", max_tokens=100, messages=user("stream me please")
    ) as stream:
        pieces = list(stream.text_stream)
        message = stream.get_final_message()
    assert len(pieces) == 4
    assert "".join(pieces) == "[mock-o/llama3:8b] echo: stream me please"
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (3, 5)

    with httpx.stream(
        "POST",
        f"{gateway.server.base_url}/v1/messages",
        json={
            "model": "llama3:8b",
            "max_tokens": 10,
            "stream": True,
            "messages": user("x"),
        },
        headers={"x-api-key": gateway.key, "anthropic-version": "2023-06-01"},
        timeout=10,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        names = [
            line[7:] for line in response.iter_lines() if line.startswith("event: ")
        ]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[3:-3] == ["content_block_delta"] * 4
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tools_round_trip_through_an_openai_backend(gateway: Gateway) -> None:
    client = gateway.client()
    first = client.messages.create(
        model="llama3:8b",
        max_tokens=100,
        tools=[WEATHER],
        messages=user("Oslo"),
    )
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use"
    assert (call.name, call.input) == ("weather", {"city": "Oslo", "days": 1})
    sent = json.loads(_last_request(gateway.o)["body"])
    assert sent["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]

    second = client.messages.create(
        model="llama3:8b",
        max_tokens=100,
        tools=[WEATHER],
        messages=[
            *user("Oslo"),
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "-3C"}
                ],
            },
        ],
    )
    assert second.content[0].text == "[mock-o/llama3:8b] echo: tool result: -3C"
    sent = json.loads(_last_request(gateway.o)["body"])
    assert sent["messages"][-1] == {
        "role": "tool",
        "tool_call_id": call.id,
        "content": "-3C",
    }


def test_streamed_tool_calls_arrive_as_input_json_deltas(gateway: Gateway) -> None:
    _mock(gateway.o, tool_arguments={"city": "Bergen", "units": ["C"]})
    with gateway.client().messages.stream(
        model="llama3:8b", max_tokens=100, tools=[WEATHER], messages=user("x")
    ) as stream:
        deltas = [
            event.delta.partial_json
            for event in stream
            if event.type == "content_block_delta"
        ]
        message = stream.get_final_message()
    assert len(deltas) == 4
    assert json.loads("".join(deltas)) == {"city": "Bergen", "units": ["C"]}
    assert message.content[0].input == {"city": "Bergen", "units": ["C"]}
    assert message.stop_reason == "tool_use"


def test_images_go_to_a_vision_model_as_data_urls(gateway: Gateway) -> None:
    message = gateway.client().messages.create(
        model="llava:7b",
        max_tokens=100,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": PNG,
                        },
                    },
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    )
    assert message.content[0].text == "[mock-o/llava:7b] echo: What is this?"
    sent = json.loads(_last_request(gateway.o)["body"])
    assert sent["messages"][0]["content"][0] == {
        "type": "image_url",
        "image_url": {"url": f"data:image/png;base64,{PNG}"},
    }
    with pytest.raises(anthropic.BadRequestError, match="vision"):
        gateway.client().messages.create(
            model="llama3:8b",
            max_tokens=10,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "url", "url": "https://x.test/a.png"},
                        }
                    ],
                }
            ],
        )


def test_count_tokens_estimates(gateway: Gateway) -> None:
    counted = gateway.client().messages.count_tokens(
        model="llama3:8b", system="a" * 40, messages=user("b" * 40)
    )
    assert counted.input_tokens == 20
    with pytest.raises(anthropic.NotFoundError):
        gateway.client().messages.count_tokens(model="nope", messages=user("x"))


def test_errors_raise_the_sdks_matching_exceptions(gateway: Gateway) -> None:
    with pytest.raises(anthropic.AuthenticationError) as raised:
        gateway.client(api_key="wrong").messages.create(
            model="llama3:8b", max_tokens=5, messages=user("x")
        )
    assert raised.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as raised:
        gateway.client().messages.create(model="nope", max_tokens=5, messages=user("x"))
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        gateway.client().messages.create(
            model="llama3:8b",
            max_tokens=5,
            messages=user("x"),
            extra_body={"max_tokens": None},
        )
    with pytest.raises(anthropic.BadRequestError, match="document"):
        gateway.client().messages.create(
            model="llama3:8b",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {
                                "type": "text",
                                "media_type": "text/plain",
                                "data": "d",
                            },
                        }
                    ],
                }
            ],
        )
    _mock(gateway.o, fail_status=503, error_rate=1)
    with pytest.raises(anthropic.InternalServerError) as raised:
        gateway.client().messages.create(
            model="llama3:8b", max_tokens=5, messages=user("x")
        )
    assert raised.value.body["error"]["type"] == "overloaded_error"


def test_the_key_is_read_from_x_api_key_or_a_bearer_token(gateway: Gateway) -> None:
    bearer = anthropic.Anthropic(
        base_url=gateway.server.base_url, auth_token=gateway.key, max_retries=0
    )
    reply = bearer.messages.create(model="llama3:8b", max_tokens=5, messages=user("x"))
    assert reply.content[0].text.endswith("echo: x")
    response = httpx.post(
        f"{gateway.server.base_url}/v1/messages",
        json={"model": "llama3:8b", "max_tokens": 5, "messages": user("x")},
        timeout=10,
    )
    assert response.status_code == 401
    assert "x-api-key" in response.json()["error"]["message"]


def test_the_sdk_lists_and_retrieves_models_in_anthropics_shape(
    gateway: Gateway,
) -> None:
    client = gateway.client()
    models = list(client.models.list())
    assert [m.id for m in models] == ["claude-x", "llama3:8b", "llava:7b"]
    assert {m.type for m in models} == {"model"}
    assert models[0].display_name == "claude-x" and models[0].created_at.year > 2000

    # Pages by limit and the cursors, as the SDK follows them.
    first = client.models.list(limit=2)
    assert [m.id for m in first.data] == ["claude-x", "llama3:8b"]
    assert first.has_more is True and first.last_id == "llama3:8b"
    assert [m.id for page in first.iter_pages() for m in page.data] == [
        "claude-x",
        "llama3:8b",
        "llava:7b",
    ]
    before = client.models.list(before_id="llava:7b", limit=1)
    assert [m.id for m in before.data] == ["llama3:8b"] and before.has_more is True

    assert client.models.retrieve("llava:7b").id == "llava:7b"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.body["error"]["type"] == "not_found_error"
    for limit in ("0", "1001", "x", "²", "9" * 5000):
        answer = httpx.get(
            f"{gateway.server.base_url}/v1/models",
            params={"limit": limit},
            headers={"x-api-key": gateway.key, "anthropic-version": "2023-06-01"},
            timeout=10,
        )
        assert answer.status_code == 400, (limit[:10], answer.text)
        assert answer.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        gateway.client(api_key="nx-not-a-key").models.list()

    # OpenAI clients keep OpenAI's list at the same path.
    assert {m.object for m in gateway.openai().models.list()} == {"model"}


def test_a_backend_dying_mid_stream_ends_with_an_anthropic_error_event(
    gateway: Gateway,
) -> None:
    _mock(gateway.o, drop_after_chunks=2)
    texts = []
    with (
        pytest.raises(anthropic.APIStatusError, match="mid-stream"),
        gateway.client().messages.stream(
            model="llama3:8b", max_tokens=100, messages=user("a b c d e f")
        ) as stream,
    ):
        texts.extend(stream.text_stream)
    assert len(texts) == 2


@pytest.mark.parametrize("mock", ["o", "c"])
def test_hanging_up_mid_stream_closes_the_upstream_request(
    gateway: Gateway, mock: str
) -> None:
    process = getattr(gateway, mock)
    _mock(process, chunks=100, chunk_delay_ms=100)
    model = "llama3:8b" if mock == "o" else "claude-x"
    with httpx.stream(
        "POST",
        f"{gateway.server.base_url}/v1/messages",
        json={"model": model, "max_tokens": 500, "stream": True, "messages": user("x")},
        headers={"x-api-key": gateway.key, "anthropic-version": "2023-06-01"},
        timeout=10,
    ) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 5
    while True:
        stats = httpx.get(f"{process.base_url}/_mock/stats", timeout=5).json()
        if stats["client_disconnects"] >= 1 and stats["in_flight"] == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


# --- pass-through: Anthropic client, Anthropic backend ----------------------


def test_an_anthropic_backend_gets_the_body_untranslated(gateway: Gateway) -> None:
    raw = gateway.client().messages.with_raw_response.create(
        model="claude-x",
        max_tokens=100,
        system=[
            {
                "type": "text",
                "text": "Be brief.",
                "cache_control": {"type": "ephemeral"},
            }
        ],
        messages=user("Hello"),
        extra_headers={"anthropic-beta": "some-beta-2025"},
    )
    message = raw.parse()
    assert raw.headers["x-nexus-backend"] == "mock-c"
    assert message.id.startswith("msg_mock")  # the backend's own Message
    assert message.content[0].text == "[mock-c/claude-x] echo: Hello"
    sent = _last_request(gateway.c)
    assert sent["path"] == "/v1/messages"
    assert sent["headers"]["x-api-key"] == UPSTREAM_KEY
    assert sent["headers"]["anthropic-beta"] == "some-beta-2025"
    assert json.loads(sent["body"])["system"][0]["cache_control"] == {
        "type": "ephemeral"
    }


def test_an_anthropic_backend_streams_through_with_tools(gateway: Gateway) -> None:
    with gateway.client().messages.stream(
        model="claude-x", max_tokens=100, tools=[WEATHER], messages=user("Oslo")
    ) as stream:
        message = stream.get_final_message()
    assert message.content[0].input == {"city": "Oslo", "days": 1}
    assert (message.usage.input_tokens, message.usage.output_tokens) == (1, 1)


def test_pass_through_keeps_what_translation_cannot_carry(gateway: Gateway) -> None:
    message = gateway.client().messages.create(
        model="claude-x",
        max_tokens=100,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "document",
                        "source": {
                            "type": "text",
                            "media_type": "text/plain",
                            "data": "d",
                        },
                    },
                    {"type": "text", "text": "Summarise"},
                ],
            }
        ],
    )
    assert message.content[0].text == "[mock-c/claude-x] echo: Summarise"


def test_a_pass_through_stream_cut_short_ends_with_an_error_event(
    gateway: Gateway,
) -> None:
    _mock(gateway.c, drop_after_chunks=2)
    with (
        pytest.raises(anthropic.APIStatusError, match="mid-stream"),
        gateway.client().messages.stream(
            model="claude-x", max_tokens=100, messages=user("a b c d e f")
        ) as stream,
    ):
        list(stream.text_stream)


# --- OpenAI clients, translated for an Anthropic backend --------------------


def test_openai_clients_get_chat_completions_from_an_anthropic_backend(
    gateway: Gateway,
) -> None:
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="claude-x",
        messages=[{"role": "system", "content": "Be brief."}, *user("Hello")],
    )
    reply = raw.parse()
    assert raw.headers["x-nexus-backend"] == "mock-c"
    assert reply.choices[0].message.content == "[mock-c/claude-x] echo: Hello"
    assert reply.choices[0].finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3, 3)
    sent = _last_request(gateway.c)
    assert sent["path"] == "/v1/messages"
    assert sent["headers"]["x-api-key"] == UPSTREAM_KEY
    assert sent["headers"]["anthropic-version"] == "2023-06-01"
    body = json.loads(sent["body"])
    assert body["system"] == "Be brief."
    assert body["max_tokens"] == 4096


def test_openai_streams_and_tools_from_an_anthropic_backend(gateway: Gateway) -> None:
    chunks = list(
        gateway.openai().chat.completions.create(
            model="claude-x",
            messages=user("stream this"),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "[mock-c/claude-x] echo: stream this"
    assert chunks[-1].usage.completion_tokens == 4

    reply = gateway.openai().chat.completions.create(
        model="claude-x",
        messages=user("Oslo"),
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "parameters": WEATHER["input_schema"],
                },
            }
        ],
    )
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 1}


def test_anthropic_backend_errors_reach_openai_clients_in_their_shape(
    gateway: Gateway,
) -> None:
    with pytest.raises(openai.BadRequestError, match="n: Anthropic"):
        gateway.openai().chat.completions.create(
            model="claude-x", messages=user("x"), n=2
        )
    _mock(gateway.c, fail_status=429, error_rate=1)
    with pytest.raises(openai.RateLimitError, match="Injected failure"):
        gateway.openai().chat.completions.create(model="claude-x", messages=user("x"))
    _mock(gateway.c, fail_status=429, error_rate=0, drop_after_chunks=1)
    with pytest.raises(openai.APIError, match="mid-stream"):
        list(
            gateway.openai().chat.completions.create(
                model="claude-x", messages=user("a b c"), stream=True
            )
        )


# --- usage ---------------------------------------------------------------------


def test_usage_is_what_the_backends_reported_on_every_path(
    gateway: Gateway, django_db_blocker
) -> None:
    # Read outside any test transaction (as the module fixture writes): a
    # transactional test would flush the database the server reads after it.
    client = gateway.client(api_key=gateway.usage_key)
    expected = []
    for model in ("llama3:8b", "claude-x"):
        message = client.messages.create(
            model=model, max_tokens=50, messages=user("count these words")
        )
        expected.append((message.usage.input_tokens, message.usage.output_tokens))
        with client.messages.stream(
            model=model, max_tokens=50, messages=user("and these four")
        ) as stream:
            final = stream.get_final_message()
        expected.append((final.usage.input_tokens, final.usage.output_tokens))
    reply = gateway.openai(gateway.usage_key).chat.completions.create(
        model="claude-x", messages=user("one two")
    )
    expected.append((reply.usage.prompt_tokens, reply.usage.completion_tokens))
    with django_db_blocker.unblock():
        prefix = ApiKey.objects.get(name="messages-usage").prefix
        deadline = time.monotonic() + 15
        while True:
            if settings.NEXUS_USAGE_TRANSPORT == "redis":
                drain_usage_stream()
            rows = UsageRecord.objects.filter(api_key_prefix=prefix)
            if rows.count() >= len(expected) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        recorded = sorted(
            (row.prompt_tokens, row.completion_tokens, row.estimated) for row in rows
        )
        endpoints = sorted(rows.values_list("endpoint", flat=True))
    assert recorded == sorted((i, o, False) for i, o in expected)
    assert endpoints == ["chat"] + ["messages"] * 4
    # Metrics count the surface like any other.
    metrics = httpx.get(f"{gateway.server.base_url}/metrics", timeout=5).text
    assert 'surface="messages"' in metrics
    assert 'backend="mock-c"' in metrics
