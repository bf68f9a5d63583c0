"""OpenTelemetry traces of the requests the proxy serves (off unless configured).

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)
set, every request the proxy serves gets a server span with child spans for
the cache lookup, admission's wait, the routing decision and each upstream
attempt, carrying the GenAI semantic-convention attributes
(``gen_ai.operation.name``, ``gen_ai.request.model``,
``gen_ai.response.model``, ``gen_ai.usage.input_tokens`` and
``output_tokens``, ``gen_ai.system``) and the client key's name (never its
secret). Each attempt's W3C ``traceparent`` goes to the backend, and a
client's own ``traceparent`` makes the request part of the client's trace.

The request path only records: a span is a small ``SpanRecord`` (ids, times,
a dict of attributes), handed whole to the SDK's ``BatchSpanProcessor``
when it ends. The processor's thread turns records into the SDK's spans and
exports them over OTLP/HTTP (protobuf) in batches, off the request path;
the SDK's own span objects cost several times more per span, which the
request would pay. Off, the proxy finds ``None`` where the request's trace
would be and makes no call here at all.

The standard variables: the exporter's (``OTEL_EXPORTER_OTLP_*``: endpoint,
headers, timeout, compression, certificates), ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, the batch processor's ``OTEL_BSP_*``, the
sampler (``OTEL_TRACES_SAMPLER`` and ``_ARG``: the specification's six
samplers), ``OTEL_SDK_DISABLED`` and ``OTEL_TRACES_EXPORTER=none``.
Propagation is W3C Trace Context (``traceparent``, ``tracestate``).
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from gateway.otlp import encode_request

if TYPE_CHECKING:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

    from routing.core import Route, Target

logger = logging.getLogger(__name__)

# gen_ai.operation.name of each endpoint label (gateway/proxy/surfaces.py).
OPERATIONS = {
    "chat": "chat",
    "messages": "chat",
    "responses": "chat",
    "ollama-chat": "chat",
    "completions": "text_completion",
    "ollama-generate": "text_completion",
    "embeddings": "embeddings",
    "ollama-embed": "embeddings",
    "count_tokens": "count_tokens",
}
# gen_ai.system of each backend kind (the semantic conventions' own names
# where they have one; the kind's name elsewhere).
SYSTEMS = {"openai": "openai", "anthropic": "anthropic"}
SERVICE_NAME = "nexus"
SCOPE_NAME = "nexus.gateway"
# Span kinds and status codes, as OTLP numbers them.
INTERNAL, SERVER, CLIENT = 1, 2, 3
ERROR = 2
# W3C Trace Context: a traceparent's fields, and what a tracestate may carry on.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
MAX_TRACEPARENT = 512
MAX_TRACESTATE = 512
SAMPLED = 0x01
_ID_LIMIT = 1 << 64
_TRUE = ("1", "true", "yes", "on")
# The SDK logs a warning for every span it drops while its queue is full
# (the collector is down or slow): once a minute is enough.
QUEUE_FULL_LOG_SECONDS = 60.0


def is_configured(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces (an OTLP endpoint, not disabled)."""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return (
        bool(endpoint)
        and environ.get("OTEL_SDK_DISABLED", "").strip().lower() not in _TRUE
        and environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() != "none"
    )


@dataclass(frozen=True, slots=True)
class Sampling:
    """Which traces to keep: a share of trace ids, or the parent's choice."""

    parent_based: bool = True
    # Trace ids whose low 64 bits are below this are kept (2**64: all).
    bound: int = _ID_LIMIT

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Sampling:
        """``OTEL_TRACES_SAMPLER`` (default ``parentbased_always_on``) and its
        ``OTEL_TRACES_SAMPLER_ARG`` (the ratio of the ``traceidratio`` ones)."""
        name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on")
        name = name.strip().lower()
        parent_based = name.startswith("parentbased_")
        base = name.removeprefix("parentbased_")
        if base == "always_on":
            return cls(parent_based, _ID_LIMIT)
        if base == "always_off":
            return cls(parent_based, 0)
        if base == "traceidratio":
            try:
                ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
            except ValueError:
                ratio = -1.0
            if not 0.0 <= ratio <= 1.0:
                logger.warning(
                    "OTEL_TRACES_SAMPLER_ARG must be a ratio from 0 to 1: "
                    "sampling every trace"
                )
                ratio = 1.0
            return cls(parent_based, round(ratio * _ID_LIMIT))
        logger.warning(
            "OTEL_TRACES_SAMPLER=%s is not one of always_on, always_off, "
            "traceidratio and their parentbased_ forms: using "
            "parentbased_always_on",
            name,
        )
        return cls()

    def is_sampled(self, trace_id: int, parent_flags: int | None) -> bool:
        """Keep this trace? (``parent_flags``: a remote parent's, if any)."""
        if self.parent_based and parent_flags is not None:
            return bool(parent_flags & SAMPLED)
        return trace_id % _ID_LIMIT < self.bound


# What the batch processor checks of a span it is handed: every record
# handed to it belongs to a sampled trace.
_SAMPLED_CONTEXT = SimpleNamespace(trace_flags=SimpleNamespace(sampled=True))


class SpanRecord:
    """One span as the request path records it (made an SDK span when exported)."""

    __slots__ = (
        "attributes",
        "end",
        "kind",
        "message",
        "name",
        "parent_id",
        "remote_parent",
        "span_id",
        "start",
        "status",
        "trace_id",
        "trace_state",
    )
    context = _SAMPLED_CONTEXT

    def __init__(
        self,
        name: str,
        kind: int,
        trace_id: int,
        parent_id: int,
        attributes: dict[str, Any],
        start: int | None = None,
        remote_parent: bool = False,
        trace_state: str = "",
    ) -> None:
        self.name = name
        self.kind = kind
        self.trace_id = trace_id
        self.span_id = random.getrandbits(64) or 1
        self.parent_id = parent_id
        self.remote_parent = remote_parent
        self.attributes = attributes
        self.start = time.time_ns() if start is None else start
        self.end = 0
        self.status = 0
        self.message = ""
        self.trace_state = trace_state

    def fail(self, error_type: str, message: str = "") -> None:
        """Mark the span failed (``error.type`` and an error status)."""
        self.attributes["error.type"] = error_type
        self.status = ERROR
        self.message = message


class _Exporting:
    """The batch processor's exporter: records encoded (gateway/otlp.py) and
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
        self.emit = processor.on_end

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
            found = _parse_traceparent(parent)
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
        return RequestTrace(self, span, sampled, state)

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


def _parse_traceparent(value: bytes) -> tuple[int, int, int] | None:
    """A valid W3C traceparent's trace id, parent span id and flags."""
    if len(value) > MAX_TRACEPARENT:
        return None
    text = value.decode("latin-1").strip()
    found = _TRACEPARENT.match(text)
    if found is None:
        return None
    version, trace_id, span_id, flags = found.groups()
    # Version 00 has exactly these fields; a later one may add more after "-".
    rest = text[found.end() :]
    if version == "ff" or (version == "00" and rest) or (rest and rest[0] != "-"):
        return None
    trace, span = int(trace_id, 16), int(span_id, 16)
    if not trace or not span:
        return None
    return trace, span, int(flags, 16)


class RequestTrace:
    """One request's spans: the server span and the children it opens."""

    __slots__ = ("emit", "flags", "sampled", "span", "tracestate")

    def __init__(
        self, tracing: Tracing, span: SpanRecord, sampled: bool, tracestate: str
    ) -> None:
        self.emit = tracing.emit
        self.span = span
        self.sampled = sampled
        self.flags = "01" if sampled else "00"
        self.tracestate = tracestate

    def child(self, name: str, start_time: int | None = None) -> SpanRecord:
        """Open an internal span under the request's server span (now, or at
        `start_time`, in nanoseconds since the epoch)."""
        server = self.span
        return SpanRecord(
            name,
            INTERNAL,
            server.trace_id,
            server.span_id,
            {},
            start_time,
            trace_state=self.tracestate,
        )

    def end(self, span: SpanRecord) -> None:
        """End a span and hand it to the batch processor (if sampled)."""
        span.end = time.time_ns()
        if self.sampled:
            self.emit(span)  # type: ignore[arg-type]  # a record, exported as a span

    def note_request(
        self, endpoint: str, model: str, stream: bool, key_name: str, key_prefix: str
    ) -> None:
        """Name what was asked, and by which key (once the body is read)."""
        attributes = self.span.attributes
        operation = OPERATIONS.get(endpoint)
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
        if model:
            attributes["gen_ai.request.model"] = model
        attributes["nexus.stream"] = stream
        if key_prefix:
            attributes["nexus.key.name"] = key_name
            attributes["nexus.key.prefix"] = key_prefix

    def end_cache_lookup(self, span: SpanRecord, result: str) -> None:
        span.attributes["nexus.cache.result"] = result
        self.end(span)

    def end_admission(self, span: SpanRecord, outcome: str, error: str = "") -> None:
        span.attributes["nexus.admission.outcome"] = outcome
        if error:
            span.fail(error)
        self.end(span)

    def end_route(self, span: SpanRecord, route: Route | None, error: str = "") -> None:
        """End the routing span with the decision (or the refusal)."""
        if route is not None:
            decision, target = route.decision, route.target
            attributes = span.attributes
            attributes["nexus.route.via"] = str(decision.via or "")
            attributes["nexus.route.strategy"] = str(decision.strategy)
            attributes["nexus.route.model"] = target.model.name
            attributes["nexus.route.backend"] = target.backend.name
            attributes["nexus.route.candidates"] = 1 + len(route.retry_targets)
        if error:
            span.fail(error)
        self.end(span)

    def start_attempt(self, endpoint: str, target: Target, position: int) -> SpanRecord:
        """Open the client span of one try of a backend (the first: position 0)."""
        backend, model = target.backend, target.model.name
        operation = OPERATIONS.get(endpoint, endpoint)
        server = self.span
        return SpanRecord(
            f"{operation} {model}",
            CLIENT,
            server.trace_id,
            server.span_id,
            {
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": model,
                "gen_ai.system": SYSTEMS.get(backend.kind, backend.kind),
                "nexus.backend": backend.name,
                "nexus.backend.kind": backend.kind,
                "nexus.attempt": position,
                "nexus.retry": position > 0,
            },
            trace_state=self.tracestate,
        )

    def inject(self, span: SpanRecord, headers: dict[str, str]) -> dict[str, str]:
        """The upstream headers with the attempt's ``traceparent`` (a copy)."""
        headers = dict(headers)
        headers["traceparent"] = (
            f"00-{span.trace_id:032x}-{span.span_id:016x}-{self.flags}"
        )
        if self.tracestate:
            headers["tracestate"] = self.tracestate
        return headers

    def end_attempt(
        self,
        span: SpanRecord,
        target: Target,
        status: int | None,
        failure: str,
        usage: tuple[int, int] | None,
        response_model: str,
    ) -> None:
        """End an attempt's span: the backend's status, or why it failed.

        The attempt that answers also names its system on the server span.
        """
        attributes = span.attributes
        if status is not None:
            attributes["http.response.status_code"] = status
        if failure:
            span.fail(failure.split(":", 1)[0][:64], failure[:512])
        elif status is not None and status >= 400:
            span.fail(str(status))
        else:
            attributes["gen_ai.response.model"] = response_model
            kind = target.backend.kind
            self.span.attributes["gen_ai.system"] = SYSTEMS.get(kind, kind)
            if usage is not None:
                attributes["gen_ai.usage.input_tokens"] = usage[0]
                attributes["gen_ai.usage.output_tokens"] = usage[1]
        self.end(span)

    def finish(
        self,
        status: int,
        error: str,
        backend: str,
        response_model: str,
        usage: tuple[int, int] | None,
        retries: int,
        cache_hit: bool,
    ) -> None:
        """End the server span with what the request came to."""
        span = self.span
        attributes = span.attributes
        if status:
            attributes["http.response.status_code"] = status
        if backend:
            attributes["nexus.backend"] = backend
        if response_model:
            attributes["gen_ai.response.model"] = response_model
        if usage is not None:
            attributes["gen_ai.usage.input_tokens"] = usage[0]
            attributes["gen_ai.usage.output_tokens"] = usage[1]
        if retries:
            attributes["nexus.retries"] = retries
        if cache_hit:
            attributes["nexus.cache.hit"] = True
        # A server span fails on a 5xx (a 4xx is the client's error).
        if status >= 500 or (not status and error):
            span.fail(error or str(status), error)
        elif error:
            attributes["error.type"] = error
        self.end(span)
