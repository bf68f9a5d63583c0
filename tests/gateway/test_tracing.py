"""The tracing core (gateway/tracing/): when it is on, the W3C traceparent it
reads and writes, sampling, and what a batch of records becomes on the wire
(through the real OTLP/HTTP exporter to the test receiver)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.tracing import Sampling, Tracing, is_configured, parse_traceparent
from tests.otlp_receiver import otlp_receiver

pytestmark = pytest.mark.mode_independent

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


def test_traces_are_off_without_an_endpoint_and_when_disabled() -> None:
    assert Tracing.from_environment({}) is None
    assert not is_configured({})
    assert is_configured(ENDPOINT)
    assert is_configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c/v1/traces"})
    assert not is_configured({**ENDPOINT, "OTEL_SDK_DISABLED": "true"})
    assert not is_configured({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"})


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"garbage",
        f"00-{TRACE}-{PARENT}".encode(),  # no flags
        f"00-{'0' * 32}-{PARENT}-01".encode(),  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01".encode(),  # all-zero parent id
        f"ff-{TRACE}-{PARENT}-01".encode(),  # the forbidden version
        f"00-{TRACE}-{PARENT}-01-extra".encode(),  # version 00 has no more
        f"00-{TRACE.upper()}-{PARENT}-01".encode(),  # upper case is invalid
        f"00-{TRACE}-{PARENT}-01".encode() + b" " * 600,  # over the bound
    ],
)
def test_an_invalid_traceparent_is_ignored(value: bytes) -> None:
    assert parse_traceparent(value) is None


def test_a_valid_traceparent_is_read_and_a_later_version_may_add_fields() -> None:
    expected = (int(TRACE, 16), int(PARENT, 16), 1)
    assert parse_traceparent(f"00-{TRACE}-{PARENT}-01".encode()) == expected
    assert parse_traceparent(f"01-{TRACE}-{PARENT}-01-more".encode()) == expected


def test_sampling_follows_the_standard_samplers() -> None:
    low, high = 1, (1 << 64) - 1  # a trace id's low 64 bits decide the ratio
    half = Sampling.from_environment(
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    )
    assert half.is_sampled(low, None)
    assert not half.is_sampled(high, None)
    assert not half.parent_based and not half.is_sampled(high, 1)
    parent_based = Sampling.from_environment({})
    assert parent_based.is_sampled(high, None)
    assert not parent_based.is_sampled(high, 0)  # the caller's choice: not kept
    off = Sampling.from_environment({"OTEL_TRACES_SAMPLER": "always_off"})
    assert not off.is_sampled(low, 1)
    bad = Sampling.from_environment({"OTEL_TRACES_SAMPLER": "nonsense"})
    assert bad == Sampling()


def _target(name: str = "alpha") -> Any:
    return SimpleNamespace(
        backend=SimpleNamespace(kind="vllm", name=name), model=SimpleNamespace(name="m")
    )


def test_spans_reach_a_collector_over_otlp_http_in_one_trace() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter,
    )

    with otlp_receiver() as receiver:
        tracing = Tracing.with_exporter(
            OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces"),
            {"OTEL_SERVICE_NAME": ""},
        )
        headers = [
            (b"traceparent", f"00-{TRACE}-{PARENT}-01".encode()),
            (b"tracestate", b"vendor=1"),
        ]
        trace = tracing.start("POST", "/v1/chat/completions", "rid-1", headers)
        trace.note_request("chat", "m", True, "team key", "nx-abc")
        attempt = trace.start_attempt("chat", _target(), 0)
        sent = trace.inject(attempt, {"x": "y"})
        trace.end_attempt(attempt, _target(), 503, "", None, "m")
        trace.finish(503, "upstream_unavailable", "", "", None, 0, False)
        assert tracing.flush(10)
        spans = receiver.wait_for(lambda spans: len(spans) == 2 and spans)

    server, client = sorted(spans, key=lambda span: span.kind != "server")
    assert sent == {
        "x": "y",
        "traceparent": f"00-{TRACE}-{client.span_id}-01",
        "tracestate": "vendor=1",
    }
    assert server.trace_id == client.trace_id == TRACE
    assert server.parent_span_id == PARENT
    assert client.parent_span_id == server.span_id
    assert server.resource["service.name"] == "nexus"
    assert server.attributes["nexus.key.name"] == "team key"
    assert server.attributes["gen_ai.operation.name"] == "chat"
    assert server.is_error and server.attributes["error.type"] == "upstream_unavailable"
    assert client.is_error and client.attributes["http.response.status_code"] == 503
    assert client.attributes["gen_ai.system"] == "vllm"


def test_an_unsampled_request_exports_nothing_but_passes_the_choice_on() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter,
    )

    with otlp_receiver() as receiver:
        tracing = Tracing.with_exporter(
            OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces"), {}
        )
        headers = [(b"traceparent", f"00-{TRACE}-{PARENT}-00".encode())]
        trace = tracing.start("POST", None, "rid-2", headers)
        attempt = trace.start_attempt("chat", _target(), 0)
        assert trace.inject(attempt, {})["traceparent"].endswith("-00")
        trace.end_attempt(attempt, _target(), 200, "", (1, 2), "m")
        trace.finish(200, "", "alpha", "m", (1, 2), 0, False)
        assert tracing.flush(5)
        assert receiver.requests == 0


def test_records_are_encoded_as_the_otlp_protobuf_says() -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from gateway.tracing import SpanRecord
    from gateway.tracing.otlp import encode_request

    attributes = {
        "text": "h\u00e9llo \U0001f600",
        "yes": True,
        "no": False,
        "count": 7,
        "negative": -3,
        "huge": 2**70,
        "ratio": 0.25,
    }
    record = SpanRecord("chat m", 3, int(TRACE, 16), int(PARENT, 16), attributes)
    record.remote_parent = True
    record.trace_state = "vendor=1"
    record.end = record.start + 1500
    record.fail("upstream", "alpha: HTTP 500")
    root = SpanRecord("POST", 2, int(TRACE, 16), 0, {"nexus.request_id": "r"})
    root.end = root.start + 9
    request = ExportTraceServiceRequest()
    request.ParseFromString(
        encode_request([record, root], {"service.name": "nexus"}, ("scope", "1.0"))
    )

    (resource_spans,) = request.resource_spans
    assert resource_spans.resource.attributes[0].key == "service.name"
    (scope_spans,) = resource_spans.scope_spans
    assert (scope_spans.scope.name, scope_spans.scope.version) == ("scope", "1.0")
    span, root_span = scope_spans.spans
    assert span.trace_id.hex() == TRACE
    assert span.span_id == record.span_id.to_bytes(8, "big")
    assert span.parent_span_id.hex() == PARENT
    assert span.trace_state == "vendor=1"
    assert span.name == "chat m" and span.kind == 3
    assert span.end_time_unix_nano - span.start_time_unix_nano == 1500
    assert span.status.code == 2 and span.status.message == "alpha: HTTP 500"
    assert span.flags == 0x301  # sampled, and the parent is remote
    decoded = {
        item.key: getattr(item.value, item.value.WhichOneof("value"))
        for item in span.attributes
    }
    assert decoded == {**attributes, "huge": str(2**70), "error.type": "upstream"}
    assert root_span.parent_span_id == b""
    assert root_span.flags == 0x101
    assert root_span.status.code == 0
