"""A request's spans as the request path records them.

A span is a ``SpanRecord``: ids, two times, a dict of attributes and a
status, handed whole to the batch processor when it ends (only when the
trace is sampled). ``RequestTrace`` opens and ends a request's spans and
names what each learned (the GenAI semantic conventions' attributes, and
Nexus's own under ``nexus.``); gateway/proxy/traces.py calls it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from routing.core import Route, Target

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
# Span kinds and status codes, as OTLP numbers them.
INTERNAL, SERVER, CLIENT = 1, 2, 3
ERROR = 2

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


class RequestTrace:
    """One request's spans: the server span and the children it opens."""

    __slots__ = ("emit", "flags", "sampled", "span", "tracestate")

    def __init__(
        self,
        emit: Callable[[SpanRecord], None],
        span: SpanRecord,
        sampled: bool,
        tracestate: str,
    ) -> None:
        self.emit = emit
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
            self.emit(span)

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
