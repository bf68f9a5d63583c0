"""A process's traces: the batch processor, its exporter, and each request's start.

Records (gateway/tracing/spans.py) go to the SDK's ``BatchSpanProcessor``;
its thread encodes a batch to OTLP protobuf (gateway/tracing/otlp.py) and
sends it with the OTLP/HTTP exporter's own client, off the request path.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gateway.tracing.context import (
    MAX_TRACESTATE,
    Sampling,
    is_configured,
    parse_traceparent,
)
from gateway.tracing.otlp import encode_request
from gateway.tracing.spans import SERVER, RequestTrace, SpanRecord

if TYPE_CHECKING:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

logger = logging.getLogger(__name__)

SERVICE_NAME = "nexus"
SCOPE_NAME = "nexus.gateway"
# The SDK logs a warning for every span it drops while its queue is full
# (the collector is down or slow): once a minute is enough.
QUEUE_FULL_LOG_SECONDS = 60.0


class _Exporting:
    """The batch processor's exporter: records encoded (gateway/tracing/otlp.py) and
    sent by the OTLP/HTTP exporter's own client (its endpoint, headers,
    timeout, compression, certificates and retries, from the environment).

    That client is the exporter's private part (pinned: opentelemetry-sdk
    and the exporter 1.45.x, checked here at start-up and by the tests).
    """

    def __init__(self, exporter: OTLPSpanExporter, resource: Resource) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        client = getattr(exporter, "_client", None)
        if not callable(getattr(client, "export", None)):
            raise TypeError(
                "This opentelemetry-exporter-otlp-proto-http has no _client.export: "
                "install the version pyproject.toml names."
            )
        self.exporter = exporter
        self.send = client.export  # type: ignore[union-attr]
        self.resource = dict(resource.attributes)
        self.scope = (SCOPE_NAME, _nexus_version())
        self.results = SpanExportResult

    def export(self, spans: Sequence[SpanRecord]) -> SpanExportResult:
        data = encode_request(spans, self.resource, self.scope)
        sent = self.send(data)
        return self.results.SUCCESS if sent.success else self.results.FAILURE

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is kept here: the batch processor keeps it


class _OncePerMinute(logging.Filter):
    """Let the SDK's "Queue full" warning through once a minute."""

    def __init__(self) -> None:
        super().__init__()
        self.last = -QUEUE_FULL_LOG_SECONDS

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Queue full"):
            return True
        now = time.monotonic()
        if now - self.last < QUEUE_FULL_LOG_SECONDS:
            return False
        self.last = now
        return True


# One filter, however many Tracing objects a process builds (adding it again
# changes nothing).
_QUEUE_FULL = _OncePerMinute()


class Tracing:
    """One process's traces: sampling, and the batch processor that exports."""

    def __init__(self, processor: BatchSpanProcessor, sampling: Sampling) -> None:
        self.processor = processor
        self.sampling = sampling
        # The processor takes records for spans: it reads only their
        # context's sampled flag, and hands them to _Exporting.
        self.emit: Callable[[SpanRecord], None] = processor.on_end  # type: ignore[assignment]

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None
    ) -> Tracing | None:
        """The tracing the ``OTEL_*`` environment asks for; None when off."""
        environ = os.environ if environ is None else environ
        if not is_configured(environ):
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )

        protocol = environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        )
        if protocol.strip().lower() != "http/protobuf":
            logger.warning(
                "OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported: Nexus exports "
                "traces over OTLP/HTTP (http/protobuf) only, to port 4318 of a "
                "collector",
                protocol,
            )
        exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
        if exporter != "otlp":
            logger.warning(
                "OTEL_TRACES_EXPORTER=%s is not supported: Nexus exports traces "
                "over OTLP only (none turns them off)",
                exporter,
            )
        return cls.with_exporter(OTLPSpanExporter(), environ)

    @classmethod
    def with_exporter(
        cls, exporter: OTLPSpanExporter, environ: Mapping[str, str] | None = None
    ) -> Tracing:
        """Trace through `exporter`, in batches (the SDK's ``OTEL_BSP_*``)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        environ = os.environ if environ is None else environ
        # OTEL_SERVICE_NAME (read by the SDK) names the service, else "nexus".
        named = bool(environ.get("OTEL_SERVICE_NAME"))
        resource = Resource.create({} if named else {"service.name": SERVICE_NAME})
        exporting: Any = _Exporting(exporter, resource)
        processor = BatchSpanProcessor(exporting)
        logging.getLogger("opentelemetry.sdk._shared_internal").addFilter(_QUEUE_FULL)
        return cls(processor, Sampling.from_environment(environ))

    def start(
        self,
        method: str,
        route: str | None,
        request_id: str,
        headers: list[tuple[bytes, bytes]],
    ) -> RequestTrace:
        """Open a request's server span (a child of the client's traceparent)."""
        parent = tracestate = None
        for name, value in headers:
            if name == b"traceparent":
                parent = value
            elif name == b"tracestate":
                tracestate = value
        trace_id = parent_id = 0
        parent_flags = None
        if parent is not None:
            found = parse_traceparent(parent)
            if found is not None:
                trace_id, parent_id, parent_flags = found
        if not trace_id:
            trace_id = random.getrandbits(128) or 1
            tracestate = None
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "nexus.request_id": request_id,
        }
        if route is not None:
            attributes["http.route"] = route
        state = ""
        if tracestate is not None and len(tracestate) <= MAX_TRACESTATE:
            state = tracestate.decode("latin-1")
        span = SpanRecord(
            f"{method} {route}" if route else method,
            SERVER,
            trace_id,
            parent_id,
            attributes,
            remote_parent=True,
            trace_state=state,
        )
        sampled = self.sampling.is_sampled(trace_id, parent_flags)
        return RequestTrace(self.emit, span, sampled, state)

    def flush(self, timeout: float) -> bool:
        """Export what is still batched, within `timeout` seconds.

        The processor stays usable (a gateway may start again).
        """
        return self.processor.force_flush(int(timeout * 1000))


def _nexus_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nexus")
    except PackageNotFoundError:
        return ""
