"""OpenTelemetry traces end to end: Daphne serving Nexus with the standard
``OTEL_*`` environment, mock backends, the official openai SDK, and a real
OTLP/HTTP receiver (tests/otlp_receiver.py) decoding what Nexus exports.

One Nexus and its mocks serve the module: a chat, a stream, a fallback past
a failing backend and a request that waited in admission's queue each show
up as a trace with the spans and GenAI attributes a tracing system reads,
and the W3C traceparent of each attempt reaches the backend.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import FallbackChain, RoutingPolicy
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    mock_stats,
    start_mock_backend,
    start_nexus_server,
    wait_until,
)
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver
from usage.models import ApiKey

KEY_NAME = "tracing-team-key"
MESSAGES = [{"role": "user", "content": "trace me"}]


@dataclass
class Setup:
    nexus: NexusServer
    receiver: OtlpReceiver
    key: str
    alpha: MockBackendProcess
    broken: MockBackendProcess
    queued: MockBackendProcess

    def client(self, request_id: str, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.nexus.base_url}/v1",
            api_key=self.key,
            max_retries=0,
            timeout=30,
            default_headers={"x-request-id": request_id, **headers},
        )


def _backend(mock: MockBackendProcess, name: str, model: str) -> None:
    backend = Backend.objects.create(
        name=name, base_url=mock.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name=model)


@pytest.fixture(scope="module")
def setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[Setup]:
    mocks = []
    try:
        with otlp_receiver() as receiver:
            alpha = start_mock_backend("--models", "m", "--name", "alpha")
            mocks.append(alpha)
            broken = start_mock_backend(
                "--models", "f", "--name", "broken", "--fail-status", "500"
            )
            mocks.append(broken)
            queued = start_mock_backend(
                "--models", "q", "--name", "queued", "--slots", "1"
            )
            mocks.append(queued)
            with django_db_blocker.unblock():
                _backend(alpha, "alpha", "m")
                _backend(broken, "broken", "f")
                _backend(queued, "queued", "q")
                FallbackChain.objects.create(model="f").set_fallbacks(["m"])
                # One request at a time per backend: a second one waits in
                # admission's queue.
                policy = RoutingPolicy.load()
                policy.admission_watermark_per_backend = 1.0
                policy.full_clean()
                policy.save()
                _, key = ApiKey.objects.create_key(KEY_NAME)
            nexus = start_nexus_server(
                OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                OTEL_SERVICE_NAME="nexus-under-test",
                OTEL_BSP_SCHEDULE_DELAY="50",
                NEXUS_BREAKER_FAILURES="1000000",
            )
            try:
                yield Setup(nexus, receiver, key, alpha, broken, queued)
            finally:
                nexus.stop()
    finally:
        for mock in mocks:
            mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [span for span in spans if span.name == name]
    assert len(found) == 1, [span.name for span in spans]
    return found[0]


def _server_span(spans: list[ReceivedSpan]) -> ReceivedSpan:
    found = [span for span in spans if span.kind == "server"]
    assert len(found) == 1, [span.name for span in spans]
    return found[0]


def _attempts(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return sorted(
        (span for span in spans if span.kind == "client"),
        key=lambda span: span.attributes["nexus.attempt"],
    )


def _traceparents_at(mock: MockBackendProcess, request_id: str) -> list[str]:
    """The traceparent of each request the mock got for this request id, less
    its flags (checked: sampled)."""
    found = [
        record["headers"].get("traceparent", "")
        for record in mock_stats(mock)["last_requests"]
        if record["headers"].get("x-request-id") == request_id
    ]
    assert all(int(value[-2:], 16) & 1 for value in found), found  # sampled
    return [value[:-3] for value in found]


def test_a_chat_is_traced_with_genai_attributes_and_its_traceparent_reaches_the_backend(
    setup: Setup,
) -> None:
    request_id = uuid.uuid4().hex
    # The client's own trace: the gateway's spans join it.
    client_trace, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    reply = setup.client(
        request_id, traceparent=f"00-{client_trace}-{client_span}-01"
    ).chat.completions.create(model="m", messages=MESSAGES)

    spans = setup.receiver.trace_of(request_id)
    server = _server_span(spans)
    assert server.name == "POST /v1/chat/completions"
    assert server.trace_id == client_trace
    assert server.parent_span_id == client_span
    assert server.resource["service.name"] == "nexus-under-test"
    assert server.attributes["gen_ai.operation.name"] == "chat"
    assert server.attributes["gen_ai.request.model"] == "m"
    assert server.attributes["gen_ai.response.model"] == "m"
    assert server.attributes["gen_ai.system"] == "openai"
    assert reply.usage is not None
    assert server.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert (
        server.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
    )
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["nexus.key.name"] == KEY_NAME
    assert server.attributes["nexus.backend"] == "alpha"
    assert not server.is_error
    # The key's name and prefix, never its secret, anywhere in the trace.
    assert setup.key not in json.dumps([span.attributes for span in spans])

    route = _one(spans, "route")
    assert route.parent_span_id == server.span_id
    assert route.attributes["nexus.route.backend"] == "alpha"
    assert route.attributes["nexus.route.via"] == "direct"
    (attempt,) = _attempts(spans)
    assert attempt.name == "chat m"
    assert attempt.parent_span_id == server.span_id
    assert attempt.attributes["nexus.backend"] == "alpha"
    assert attempt.attributes["gen_ai.system"] == "openai"
    assert attempt.attributes["http.response.status_code"] == 200
    assert attempt.attributes["gen_ai.usage.output_tokens"] == (
        reply.usage.completion_tokens
    )
    assert server.start_ns <= attempt.start_ns <= attempt.end_ns <= server.end_ns
    # The backend saw the attempt's span as its parent.
    assert _traceparents_at(setup.alpha, request_id) == [attempt.traceparent]


def test_a_stream_is_traced_until_its_last_chunk(setup: Setup) -> None:
    request_id = uuid.uuid4().hex
    stream = setup.client(request_id).chat.completions.create(
        model="m",
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None

    spans = setup.receiver.trace_of(request_id)
    server = _server_span(spans)
    assert server.attributes["nexus.stream"] is True
    assert server.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert server.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    (attempt,) = _attempts(spans)
    assert attempt.attributes["http.response.status_code"] == 200
    assert not attempt.is_error
    assert _traceparents_at(setup.alpha, request_id) == [attempt.traceparent]


def test_a_fallback_shows_the_failed_attempt_and_the_one_that_answered(
    setup: Setup,
) -> None:
    request_id = uuid.uuid4().hex
    reply = setup.client(request_id).chat.completions.create(
        model="f", messages=MESSAGES
    )
    assert reply.model == "m"

    spans = setup.receiver.trace_of(request_id)
    server = _server_span(spans)
    failed, answered = _attempts(spans)
    assert failed.name == "chat f"
    assert failed.attributes["nexus.backend"] == "broken"
    assert failed.attributes["http.response.status_code"] == 500
    assert failed.is_error
    assert failed.attributes["nexus.retry"] is False
    assert answered.name == "chat m"
    assert answered.attributes["nexus.backend"] == "alpha"
    assert answered.attributes["nexus.retry"] is True
    assert not answered.is_error
    assert failed.end_ns <= answered.start_ns
    assert server.attributes["gen_ai.request.model"] == "f"
    assert server.attributes["gen_ai.response.model"] == "m"
    assert server.attributes["nexus.retries"] == 1
    assert not server.is_error
    # Each backend got its own attempt's traceparent, in the same trace.
    assert _traceparents_at(setup.broken, request_id) == [failed.traceparent]
    assert _traceparents_at(setup.alpha, request_id) == [answered.traceparent]


def test_a_request_that_waited_in_the_queue_has_an_admission_span(
    setup: Setup,
) -> None:
    # The requests let through (a band around one per backend) wait at the
    # mock until released; the others queue in admission behind them.
    httpx.post(f"{setup.queued.base_url}/_mock/hold", json={"first": 100})
    request_ids = [uuid.uuid4().hex for _ in range(5)]

    async def scenario() -> None:
        clients = [
            openai.AsyncOpenAI(
                base_url=f"{setup.nexus.base_url}/v1",
                api_key=setup.key,
                max_retries=0,
                timeout=60,
                default_headers={"x-request-id": request_id},
            )
            for request_id in request_ids
        ]
        requests = [
            asyncio.create_task(
                client.chat.completions.create(model="q", messages=MESSAGES)
            )
            for client in clients
        ]
        await asyncio.to_thread(
            wait_until,
            lambda: setup.nexus.metric("nexus_admission_queue_length") >= 2,
            60,
        )
        await asyncio.to_thread(
            httpx.post, f"{setup.queued.base_url}/_mock/release", timeout=5
        )
        await asyncio.gather(*requests)

    asyncio.run(scenario())

    traces = [setup.receiver.trace_of(request_id) for request_id in request_ids]
    waited = [
        spans for spans in traces if any(span.name == "admission" for span in spans)
    ]
    assert len(waited) >= 2
    for spans in waited:
        server = _server_span(spans)
        admission = _one(spans, "admission")
        assert admission.parent_span_id == server.span_id
        assert admission.attributes["nexus.admission.outcome"] == "dispatched"
        route = _one(spans, "route")
        assert admission.end_ns <= route.start_ns
        assert server.attributes["http.response.status_code"] == 200
    went_first = [spans for spans in traces if spans not in waited]
    assert went_first
    for spans in went_first:
        outcome = _server_span(spans).attributes["nexus.admission.outcome"]
        assert outcome == "bypassed"


def test_a_refused_request_is_traced_with_its_error(setup: Setup) -> None:
    request_id = uuid.uuid4().hex
    with pytest.raises(openai.NotFoundError):
        setup.client(request_id).chat.completions.create(
            model="no-such-model", messages=MESSAGES
        )
    spans = setup.receiver.trace_of(request_id)
    server = _server_span(spans)
    assert server.attributes["http.response.status_code"] == 404
    assert server.attributes["error.type"] == "model_not_found"
    route = _one(spans, "route")
    assert route.is_error
    assert _attempts(spans) == []
