"""An OTLP/HTTP trace receiver for tests: a real HTTP server decoding protobuf.

It listens on a free loopback port in a thread, takes ``POST /v1/traces``
(``application/x-protobuf``, gzip or not) as an OpenTelemetry collector
does, decodes each ``ExportTraceServiceRequest`` with the OTLP protobuf
definitions and keeps the spans as plain ``ReceivedSpan`` records.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SPAN_KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUS_ERROR = 2


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector got it."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str
    attributes: dict[str, Any]
    is_error: bool
    status_message: str
    start_ns: int
    end_ns: int
    resource: dict[str, Any]

    @property
    def traceparent(self) -> str:
        """The W3C traceparent of a child of this span, less its flags."""
        return f"00-{self.trace_id}-{self.span_id}"


class OtlpReceiver:
    """The spans received so far, and a way to wait for more."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.server = server
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.bytes = 0
        self.condition = threading.Condition()

    @property
    def endpoint(self) -> str:
        """The base URL to set as OTEL_EXPORTER_OTLP_ENDPOINT."""
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def add(self, spans: list[ReceivedSpan], size: int) -> None:
        with self.condition:
            self.requests += 1
            self.bytes += size
            self.spans.extend(spans)
            self.condition.notify_all()

    def wait_for(
        self, matches: Callable[[list[ReceivedSpan]], Any], timeout: float = 20.0
    ) -> Any:
        """Wait until `matches(spans)` is true; return what it returned."""
        deadline = time.monotonic() + timeout
        with self.condition:
            while True:
                found = matches(list(self.spans))
                if found:
                    return found
                left = deadline - time.monotonic()
                assert left > 0, f"no matching spans after {timeout:g} s"
                self.condition.wait(left)

    def trace_of(self, request_id: str, timeout: float = 20.0) -> list[ReceivedSpan]:
        """Every span of the trace whose server span has this request id, once
        the server span (the last to end) is in."""

        def whole(spans: list[ReceivedSpan]) -> list[ReceivedSpan] | None:
            for span in spans:
                if span.attributes.get("nexus.request_id") == request_id:
                    return [s for s in spans if s.trace_id == span.trace_id]
            return None

        found: list[ReceivedSpan] = self.wait_for(whole, timeout)
        return found


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(items: Any) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


def decode_spans(body: bytes) -> list[ReceivedSpan]:
    """The spans of one OTLP/HTTP protobuf export request."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=SPAN_KINDS.get(span.kind, "unspecified"),
                        attributes=_attributes(span.attributes),
                        is_error=span.status.code == STATUS_ERROR,
                        status_message=span.status.message,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        resource=resource,
                    )
                )
    return spans


@contextmanager
def otlp_receiver(decode: bool = True) -> Iterator[OtlpReceiver]:
    """Run a receiver for the duration of the block.

    ``decode=False`` only counts export requests and bytes: a benchmark's
    receiver must not take the CPU its load client needs.
    """
    receiver: OtlpReceiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or not self.headers.get(
                "content-type", ""
            ).startswith("application/x-protobuf"):
                self.send_error(404)
                return
            receiver.add(decode_spans(body) if decode else [], len(body))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = OtlpReceiver(server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
