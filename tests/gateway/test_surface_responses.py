"""POST /v1/responses through real processes: the openai SDK, Nexus, mock backends.

One Nexus server and one OpenAI-kind mock (with a scripted tool call) serve
the module; the mock is reset after every test.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

SHIPS_TO_REDIS = settings.NEXUS_USAGE_TRANSPORT == "redis"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": False,
}


@dataclass
class Gateway:
    server: NexusServer
    mock: MockBackendProcess
    key: str

    def sdk(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.server.base_url}/v1",
            api_key=key or self.key,
            max_retries=0,
            timeout=20,
        )

    def mock_config(self, **knobs: Any) -> None:
        reply = httpx.post(f"{self.mock.base_url}/_mock/config", json=knobs, timeout=5)
        assert reply.status_code == 200, reply.text

    def upstream_paths(self) -> list[str]:
        stats = httpx.get(f"{self.mock.base_url}/_mock/stats", timeout=5).json()
        return [r["path"] for r in stats["last_requests"]]


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, django_db_blocker: Any) -> Iterator[Gateway]:
    mock = start_mock_backend(
        "--models",
        "llama3:8b",
        "--name",
        "mock-oa",
        "--chunks",
        "4",
    )
    with django_db_blocker.unblock():
        if SHIPS_TO_REDIS:
            clear_usage_stream()
        backend = Backend.objects.create(
            name="mock-oa", base_url=mock.base_url, status=HealthStatus.HEALTHY
        )
        BackendModel.objects.create(
            backend=backend, name="llama3:8b", supports_tools=True, context_length=8192
        )
        _, key = ApiKey.objects.create_key("responses-tests")
    server = start_nexus_server(NEXUS_BREAKER_FAILURES="1000000")
    try:
        yield Gateway(server, mock, key)
    finally:
        server.stop()
        mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture(autouse=True)
def _reset_mock(gateway: Gateway) -> Iterator[None]:
    yield
    httpx.post(f"{gateway.mock.base_url}/_mock/reset", timeout=5)


def usage_record(request_id: str, django_db_blocker: Any) -> UsageRecord:
    """The usage row the server wrote for a request (waits for the flush)."""
    deadline = time.monotonic() + 15
    with django_db_blocker.unblock():
        while True:
            if SHIPS_TO_REDIS:
                drain_usage_stream()
            record = UsageRecord.objects.filter(request_id=request_id).first()
            if record is not None:
                return record
            assert time.monotonic() < deadline, "usage was not recorded"
            time.sleep(0.1)


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_the_gateway_serves_committed_configuration(gateway: Gateway) -> None:
    assert Backend.objects.filter(name="mock-oa").exists()


def test_a_response_with_instructions_and_usage_from_the_backend(
    gateway: Gateway, django_db_blocker: Any
) -> None:
    request_id = f"resp-{uuid.uuid4().hex[:8]}"
    raw = gateway.sdk().responses.with_raw_response.create(
        model="llama3:8b",
        instructions="Answer briefly.",
        input="why is the sky blue",
        extra_headers={"X-Request-ID": request_id},
    )
    response = raw.parse()
    assert raw.headers["x-nexus-backend"] == "mock-oa"
    assert response.output_text == "[mock-oa/llama3:8b] echo: why is the sky blue"
    assert response.status == "completed"
    assert response.object == "response"
    assert response.id.startswith("resp_")
    # The mock counts words: 2 + 5 in the prompt, 7 in the reply.
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (7, 7)
    assert gateway.upstream_paths() == ["/v1/chat/completions"]
    record = usage_record(request_id, django_db_blocker)
    assert (record.prompt_tokens, record.completion_tokens) == (7, 7)
    assert not record.estimated
    assert record.status == 200


def test_a_streamed_response_arrives_as_response_events(
    gateway: Gateway, django_db_blocker: Any
) -> None:
    request_id = f"resp-{uuid.uuid4().hex[:8]}"
    events = list(
        gateway.sdk().responses.create(
            model="llama3:8b",
            input=[{"role": "user", "content": "stream this please"}],
            stream=True,
            extra_headers={"X-Request-ID": request_id},
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.output_text.delta") == 4  # the mock's chunks
    assert kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "[mock-oa/llama3:8b] echo: stream this please"
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text
    assert final.usage is not None
    record = usage_record(request_id, django_db_blocker)
    assert record.streamed
    assert (record.prompt_tokens, record.completion_tokens) == (
        final.usage.input_tokens,
        final.usage.output_tokens,
    )


def test_the_stream_helper_gives_the_final_response(gateway: Gateway) -> None:
    with gateway.sdk().responses.stream(model="llama3:8b", input="hi") as stream:
        final = stream.get_final_response()
    assert final.output_text == "[mock-oa/llama3:8b] echo: hi"


def test_function_tools_round_trip(gateway: Gateway) -> None:
    sdk = gateway.sdk()
    # The mock calls the first tool offered, its string arguments the user's words.
    ask: list[Any] = [{"role": "user", "content": "Paris"}]
    first = sdk.responses.create(model="llama3:8b", input=ask, tools=[WEATHER])  # type: ignore[list-item]
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Paris"}')
    follow_up = [
        *ask,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = sdk.responses.create(model="llama3:8b", input=follow_up, tools=[WEATHER])  # type: ignore[list-item,arg-type]
    assert second.output_text == "[mock-oa/llama3:8b] echo: tool result: sunny"


def test_streamed_function_call_arguments(gateway: Gateway) -> None:
    events = list(
        gateway.sdk().responses.create(
            model="llama3:8b",
            input="Paris",
            tools=[WEATHER],  # type: ignore[list-item]
            stream=True,
        )
    )
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) == 4
    assert "".join(d.delta for d in deltas) == '{"city":"Paris"}'
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert (done.name, done.arguments) == ("get_weather", '{"city":"Paris"}')


def test_previous_response_id_is_refused_saying_why(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.sdk().responses.create(
            model="llama3:8b", input="and then?", previous_response_id="resp_123"
        )
    assert "stateless" in caught.value.message
    assert caught.value.param == "previous_response_id"  # type: ignore[attr-defined]


def test_built_in_tools_are_refused(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.sdk().responses.create(
            model="llama3:8b", input="hi", tools=[{"type": "web_search"}]
        )
    assert "function tools" in caught.value.message


def test_unknown_models_and_keys_get_openai_errors(gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError):
        gateway.sdk().responses.create(model="gpt-9", input="hi")
    with pytest.raises(openai.AuthenticationError):
        gateway.sdk(key="nx-wrong").responses.create(model="llama3:8b", input="hi")


def test_a_backend_dying_mid_stream_ends_with_response_failed(
    gateway: Gateway, django_db_blocker: Any
) -> None:
    gateway.mock_config(drop_after_chunks=2)
    request_id = f"resp-{uuid.uuid4().hex[:8]}"
    events = list(
        gateway.sdk().responses.create(
            model="llama3:8b",
            input="this will break",
            stream=True,
            extra_headers={"X-Request-ID": request_id},
        )
    )
    kinds = [event.type for event in events]
    # openai < 2 hands an `error` event on unparsed, as {"event", "data"}.
    kinds[-2] = kinds[-2] or getattr(events[-2], "event", None)
    assert kinds[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed"
    assert failed.error is not None
    record = usage_record(request_id, django_db_blocker)
    assert record.is_error
