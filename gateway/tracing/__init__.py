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
a dict of attributes; spans.py), handed whole to the SDK's
``BatchSpanProcessor`` when it ends. The processor's thread encodes the
records to OTLP protobuf (otlp.py) and exports them over OTLP/HTTP in
batches, off the request path (tracer.py); the SDK's own span objects and
encoder cost several times more per span. W3C Trace Context and sampling:
context.py. Off, the proxy finds ``None`` where the request's trace
would be and makes no call here at all.

The standard variables: the exporter's (``OTEL_EXPORTER_OTLP_*``: endpoint,
headers, timeout, compression, certificates), ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, the batch processor's ``OTEL_BSP_*``, the
sampler (``OTEL_TRACES_SAMPLER`` and ``_ARG``: the specification's six
samplers), ``OTEL_SDK_DISABLED`` and ``OTEL_TRACES_EXPORTER=none``.
Propagation is W3C Trace Context (``traceparent``, ``tracestate``).
"""

from __future__ import annotations

from gateway.tracing.context import Sampling, is_configured, parse_traceparent
from gateway.tracing.spans import RequestTrace, SpanRecord
from gateway.tracing.tracer import Tracing

__all__ = [
    "RequestTrace",
    "Sampling",
    "SpanRecord",
    "Tracing",
    "is_configured",
    "parse_traceparent",
]
