"""Trimming to a known context: the router's context 400, made an answer.

When every candidate of the model is refused only because the request is
longer than its known context (configured or discovered), context shift
trims the request to fit the largest of them and the pipeline routes it
again. The router's 400 stays when context shift is off, when another
capability is missing too, or when nothing may be dropped.
"""

from __future__ import annotations

from gateway.context_limits import ContextLimits
from gateway.proxy.context_shift import MARGIN, RequestShift
from gateway.proxy.legs import ProxyExchange
from routing.core import RequestRequirements, RoutingError
from routing.core.errors import CapabilityMismatch


def fit_known_context(
    exchange: ProxyExchange, error: BaseException | None
) -> RequestRequirements | None:
    """The trimmed request's requirements, or None to keep the router's error."""
    if not isinstance(error, CapabilityMismatch) or error.missing != (
        "context_length",
    ):
        return None
    decision = error.decision
    attempts = getattr(decision, "attempts", ())
    known = [a.largest_context for a in attempts if a.largest_context]
    if not known:
        return None
    shift = RequestShift.of(exchange, ContextLimits())
    if shift is None or not shift.fit(int(max(known) * MARGIN)):
        return None
    call = exchange.call
    canonical = exchange.payload if call is None else call.inbound.canonical
    try:
        requirements = RequestRequirements.from_request(canonical)
    except RoutingError:
        return None
    exchange.requirements = requirements
    return requirements
