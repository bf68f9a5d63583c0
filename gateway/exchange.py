"""One client request while the proxy serves it: its context and its record.

The proxy's dispatcher builds one ``Exchange`` per request and hands it along
the pipeline (key limits, admission, route, slot, forward); the accounting
turns it into the usage event, the metrics and the access log line. It is the
one place a request's facts live, so no step takes them as loose arguments.

This module sits below the proxy (and the relay, the fleet, admission): it
names none of their classes. The two type parameters stand for the proxy's
own (``gateway.proxy.legs.Call``, ``gateway.proxy.limits.BudgetMeter``); the
proxy spells the pair ``ProxyExchange``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gateway.cache.entries import Pending
from gateway.tracing import RequestTrace
from routing.core import RequestRequirements, Route
from routing.state import GatewayState
from usage.limits.limiter import Ticket
from usage.limits.policy import KeyPolicy

Headers = list[tuple[bytes, bytes]]
CallT = TypeVar("CallT")
MeterT = TypeVar("MeterT")


@dataclass(slots=True)
class Exchange(Generic[CallT, MeterT]):
    """What the proxy knows and learns about one client request."""

    request_id: str
    # The label usage and metrics are recorded under ("chat", "messages", ...;
    # "count_tokens"), "" for the paths that record nothing (model lists).
    endpoint: str
    path: str
    requested_model: str = ""
    stream: bool = False
    # Who asks (set once the key is known) and what it was routed with.
    key_prefix: str = ""
    policy: KeyPolicy | None = None
    state: GatewayState | None = None
    requirements: RequestRequirements | None = None
    # The body, parsed, and the client's bytes (passed on when they can be).
    payload: dict[str, Any] = field(default_factory=dict)
    raw: bytes = b""
    # A request on a surface other than OpenAI's: what each leg is made from.
    call: CallT | None = None
    # The client's headers (admission reads them) and the answer's, as built
    # (the request id, rate-limit headers, the backend that served it).
    request_headers: Headers = field(default_factory=list)
    response_headers: Headers = field(default_factory=list)
    route: Route | None = None  # the router's choice, once routed
    # perf_counter() when the request's body was read (a refusal: when
    # refused), and when the answer began.
    started: float = 0.0
    first_byte: float | None = None
    backend: str = ""
    served_model: str = ""
    status: int = 0
    usage: dict[str, Any] | None = None
    completion_chars: int = 0
    # Completion tokens a budget meter counted (a stream it cut): billed as is.
    counted_completion: int | None = None
    error: str = ""
    client_gone: bool = False
    retries: int = 0
    # Trimmed resends after a context overflow, and pre-trims (context shift).
    context_shifts: int = 0
    context_dropped: int = 0  # messages those dropped
    # The multiple-opinions request this one is a step of ("" for none).
    ensemble_id: str = ""
    # Bytes sent that the client has not read yet, where the server tells
    # (Daphne, through nexus_site.servers.daphne_limits); None elsewhere.
    unsent_bytes: Callable[[], int] | None = None
    # Closes the client's connection at once, dropping what it has not read
    # (Daphne); None elsewhere.
    abort: Callable[[], None] | None = None
    # What the key's limits took for this request (settled with its usage).
    limit_ticket: Ticket | None = None
    # Set for a budgeted stream: counts it as it goes and may cut it short.
    meter: MeterT | None = None
    # Characters of text relayed so far by a stream being relayed (read by
    # the usage progress of open requests, off the request path).
    live_chars: Callable[[], int] | None = None
    # The usage event's id, once the pipeline opened the request (its open and
    # its settle share it); "" for a request refused before that.
    event_id: str = ""
    # A cacheable request's miss: where its answer goes to be kept
    # (gateway/proxy/cached.py); None when the cache is off or bypassed.
    cache: Pending | None = None
    # Answered from the response cache (no backend).
    cache_hit: bool = False
    # The request's spans while traces are on (gateway/tracing/); None when off.
    trace: RequestTrace | None = None
