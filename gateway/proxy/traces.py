"""The proxy's side of tracing: what each span learns from the exchange.

The proxy calls these only for a traced request (``exchange.trace`` is not
None, gateway/tracing/); with traces off it never gets here. The spans:
the request's (opened by ``start``, closed by ``finish``), the cache lookup,
admission's wait, the routing decision, and each upstream attempt
(gateway/proxy/forward.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from gateway.proxy.accounting import token_counts
from gateway.proxy.errors import ProxyError
from gateway.proxy.legs import ProxyExchange
from gateway.proxy.surfaces import COUNT_TOKENS_PATH, ENDPOINTS, OLLAMA_PATHS
from gateway.tracing import RequestTrace, SpanRecord, Tracing
from routing.admission.vocabulary import Outcome
from routing.core import Route, RouterSnapshot, Target

if TYPE_CHECKING:
    from gateway.admission import AdmissionGate
    from routing.admission.queue import Ticket

MODELS_PATH = "/v1/models"


def start(tracing: Tracing, exchange: ProxyExchange, method: str) -> None:
    """Open the request's span (named by its route, never the raw path)."""
    path = exchange.path
    if (
        path in ENDPOINTS
        or path in OLLAMA_PATHS
        or path in (MODELS_PATH, COUNT_TOKENS_PATH)
    ):
        route: str | None = path
    elif path.startswith(MODELS_PATH + "/"):
        route = MODELS_PATH + "/{model}"
    else:
        route = None  # an unknown path: its name would be any string sent
    exchange.trace = tracing.start(
        method, route, exchange.request_id, exchange.request_headers
    )


def note_request(exchange: ProxyExchange) -> None:
    """Name the model asked for and the key asking (the body is read)."""
    assert exchange.trace is not None
    prefix = exchange.key_prefix
    state = exchange.state
    name = state.key_names.get(prefix, "") if state is not None and prefix else ""
    exchange.trace.note_request(
        exchange.endpoint, exchange.requested_model, exchange.stream, name, prefix
    )


def refused(exchange: ProxyExchange, error: ProxyError) -> None:
    """Note a refusal that happened before the pipeline noted it."""
    if not exchange.status:
        exchange.status = error.status
    if not exchange.error:
        exchange.error = error.code or error.error_type


def finish(exchange: ProxyExchange) -> None:
    """Close the request's span with its status, backend, model and tokens."""
    trace = exchange.trace
    assert trace is not None
    usage = None
    if exchange.endpoint and (exchange.backend or exchange.cache_hit):
        prompt, completion, _, _ = token_counts(exchange)
        usage = (prompt, completion)
    trace.finish(
        exchange.status,
        exchange.error,
        exchange.backend,
        exchange.served_model,
        usage,
        exchange.retries,
        exchange.cache_hit,
    )
    exchange.trace = None


def end_cache_lookup(
    exchange: ProxyExchange, trace: RequestTrace, span: SpanRecord | None, hit: bool
) -> None:
    """Close the lookup's span: hit, miss or bypass."""
    assert span is not None
    if hit:
        result = "hit"
    elif exchange.cache is not None:
        result = "miss"
    else:
        result = "bypass"
    trace.end_cache_lookup(span, result)


def start_attempt(exchange: ProxyExchange, target: Target) -> SpanRecord:
    """Open the span of one try of a backend."""
    assert exchange.trace is not None
    return exchange.trace.start_attempt(exchange.endpoint, target, exchange.retries)


def inject(
    exchange: ProxyExchange, span: SpanRecord, headers: dict[str, str]
) -> dict[str, str]:
    """The attempt's headers with its ``traceparent`` for the backend."""
    assert exchange.trace is not None
    return exchange.trace.inject(span, headers)


def end_attempt(
    exchange: ProxyExchange,
    target: Target,
    span: SpanRecord,
    status: int | None,
    failure: str,
    raised: BaseException | None,
) -> None:
    """Close an attempt's span: answered, failed (and why), or cut short."""
    assert exchange.trace is not None
    usage = None
    if not failure and raised is None and exchange.backend:
        prompt, completion, _, _ = token_counts(exchange)
        usage = (prompt, completion)
    if raised is not None and not failure:
        failure = "client_closed" if exchange.client_gone else type(raised).__name__
    exchange.trace.end_attempt(
        span, target, status, failure, usage, exchange.served_model
    )


async def admit(gate: AdmissionGate, ticket: Ticket, trace: RequestTrace) -> None:
    """Wait for admission; a wait or a refusal gets a span of its own.

    Most requests go straight through (the fleet is not busy): their
    request's span only says so, which costs no span.
    """
    started = time.time_ns()
    try:
        await gate.admit(ticket)
    except BaseException as error:
        code = getattr(error, "code", None) or type(error).__name__
        span = trace.child("admission", start_time=started)
        trace.end_admission(span, str(ticket.outcome or "refused"), str(code))
        raise
    outcome = ticket.outcome
    if outcome is Outcome.BYPASSED:
        trace.span.attributes["nexus.admission.outcome"] = outcome.value
        return
    span = trace.child("admission", start_time=started)
    trace.end_admission(span, str(outcome or "admitted"))


async def route(
    trace: RequestTrace, routing: Awaitable[tuple[Route, RouterSnapshot]]
) -> tuple[Route, RouterSnapshot]:
    """Await the routing decision (and any hold for a backend) in a span."""
    span = trace.child("route")
    try:
        chosen = await routing
    except BaseException as error:
        code = getattr(error, "code", None) or type(error).__name__
        trace.end_route(span, None, str(code))
        raise
    trace.end_route(span, chosen[0])
    return chosen
