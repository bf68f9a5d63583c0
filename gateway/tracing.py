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

The standard ``OTEL_*`` variables are the SDK's own: ``OTEL_SERVICE_NAME``
and ``OTEL_RESOURCE_ATTRIBUTES``, the sampler (``OTEL_TRACES_SAMPLER``), the
exporter's headers, timeout and compression, the batch processor's
``OTEL_BSP_*`` and the propagators (``OTEL_PROPAGATORS``).
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn it off.

Spans are exported in batches by the SDK's ``BatchSpanProcessor`` from its
own thread, never on the request path. Off, the proxy finds ``None`` where
the request's trace would be and makes no tracer call at all.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

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
# where they have one).
SYSTEMS = {"openai": "openai", "anthropic": "anthropic"}
SERVICE_NAME = "nexus"
_TRUE = ("1", "true", "yes", "on")


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


class Tracing:
    """One process's tracer: its provider, batch processor and exporter."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context

        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("nexus.gateway")
        self._propagator = propagate.get_global_textmap()
        self._in_context = set_span_in_context
        self._server = SpanKind.SERVER
        self._client = SpanKind.CLIENT
        self._error = StatusCode.ERROR

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
        return cls.with_exporter(OTLPSpanExporter())

    @classmethod
    def with_exporter(cls, exporter: SpanExporter) -> Tracing:
        """Trace through `exporter`, in batches (the SDK's ``OTEL_BSP_*``)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # OTEL_SERVICE_NAME (read by the SDK) names the service, else "nexus".
        named = bool(os.environ.get("OTEL_SERVICE_NAME"))
        resource = Resource.create({} if named else {"service.name": SERVICE_NAME})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    def start(
        self,
        method: str,
        route: str | None,
        request_id: str,
        headers: list[tuple[bytes, bytes]],
    ) -> RequestTrace:
        """Open a request's server span (a child of the client's traceparent)."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name in (b"traceparent", b"tracestate", b"baggage")
        }
        parent = self._propagator.extract(carrier) if carrier else None
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "nexus.request_id": request_id,
        }
        if route is not None:
            attributes["http.route"] = route
        span = self.tracer.start_span(
            f"{method} {route}" if route else method,
            context=parent,
            kind=self._server,
            attributes=attributes,
        )
        return RequestTrace(self, span)

    def flush(self, timeout: float) -> bool:
        """Export what is still batched, within `timeout` seconds.

        The provider stays usable (a gateway may start again); the SDK shuts
        it down at the process's exit.
        """
        return self.provider.force_flush(int(timeout * 1000))


class RequestTrace:
    """One request's spans: the server span and the children it opens."""

    __slots__ = ("_context", "span", "tracing")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing = tracing
        self.span = span
        self._context: Context = tracing._in_context(span)

    def child(self, name: str, start_time: int | None = None) -> Span:
        """Open an internal span under the request's server span (now, or at
        `start_time`, in nanoseconds since the epoch)."""
        return self.tracing.tracer.start_span(
            name, context=self._context, start_time=start_time
        )

    def note_request(
        self, endpoint: str, model: str, stream: bool, key_name: str, key_prefix: str
    ) -> None:
        """Name what was asked, and by which key (once the body is read)."""
        span = self.span
        operation = OPERATIONS.get(endpoint)
        if operation is not None:
            span.set_attribute("gen_ai.operation.name", operation)
        if model:
            span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("nexus.stream", stream)
        if key_prefix:
            span.set_attribute("nexus.key.name", key_name)
            span.set_attribute("nexus.key.prefix", key_prefix)

    def end_cache_lookup(self, span: Span, result: str) -> None:
        span.set_attribute("nexus.cache.result", result)
        span.end()

    def end_admission(self, span: Span, outcome: str, error: str = "") -> None:
        span.set_attribute("nexus.admission.outcome", outcome)
        if error:
            span.set_attribute("error.type", error)
            span.set_status(self.tracing._error, error)
        span.end()

    def end_route(self, span: Span, route: Route | None, error: str = "") -> None:
        """Close the routing span with the decision (or the refusal)."""
        if route is not None:
            decision, target = route.decision, route.target
            span.set_attribute("nexus.route.via", str(decision.via or ""))
            span.set_attribute("nexus.route.strategy", str(decision.strategy))
            span.set_attribute("nexus.route.model", target.model.name)
            span.set_attribute("nexus.route.backend", target.backend.name)
            span.set_attribute("nexus.route.candidates", 1 + len(route.retry_targets))
        if error:
            span.set_attribute("error.type", error)
            span.set_status(self.tracing._error, error)
        span.end()

    def start_attempt(self, endpoint: str, target: Target, position: int) -> Span:
        """Open the client span of one try of a backend (the first: position 0)."""
        backend, model = target.backend, target.model.name
        operation = OPERATIONS.get(endpoint, endpoint)
        return self.tracing.tracer.start_span(
            f"{operation} {model}",
            context=self._context,
            kind=self.tracing._client,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": model,
                "gen_ai.system": SYSTEMS.get(backend.kind, backend.kind),
                "nexus.backend": backend.name,
                "nexus.backend.kind": backend.kind,
                "nexus.attempt": position,
                "nexus.retry": position > 0,
            },
        )

    def inject(self, span: Span, headers: dict[str, str]) -> dict[str, str]:
        """The upstream headers with the attempt's ``traceparent`` (a copy)."""
        headers = dict(headers)
        tracing = self.tracing
        tracing._propagator.inject(headers, context=tracing._in_context(span))
        return headers

    def end_attempt(
        self,
        span: Span,
        target: Target,
        status: int | None,
        failure: str,
        usage: tuple[int, int] | None,
        response_model: str,
    ) -> None:
        """Close an attempt's span: the backend's status, or why it failed.

        The attempt that answers also names its system on the server span.
        """
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if failure:
            span.set_attribute("error.type", failure.split(":", 1)[0][:64])
            span.set_status(self.tracing._error, failure[:512])
        elif status is not None and status >= 400:
            span.set_attribute("error.type", str(status))
            span.set_status(self.tracing._error)
        else:
            span.set_attribute("gen_ai.response.model", response_model)
            kind = target.backend.kind
            self.span.set_attribute("gen_ai.system", SYSTEMS.get(kind, kind))
            if usage is not None:
                span.set_attribute("gen_ai.usage.input_tokens", usage[0])
                span.set_attribute("gen_ai.usage.output_tokens", usage[1])
        span.end()

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
        """Close the server span with what the request came to."""
        span = self.span
        if status:
            span.set_attribute("http.response.status_code", status)
        if backend:
            span.set_attribute("nexus.backend", backend)
        if response_model:
            span.set_attribute("gen_ai.response.model", response_model)
        if usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", usage[0])
            span.set_attribute("gen_ai.usage.output_tokens", usage[1])
        if retries:
            span.set_attribute("nexus.retries", retries)
        if cache_hit:
            span.set_attribute("nexus.cache.hit", True)
        if error:
            span.set_attribute("error.type", error)
        if status >= 500 or (not status and error):
            span.set_status(self.tracing._error, error or str(status))
        span.end()
