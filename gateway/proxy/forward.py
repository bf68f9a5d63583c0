"""Forwarding a routed request: its candidates in turn, retried before any byte.

``forward`` tries the chosen backend, then the route's retry targets, until
one gives an answer worth relaying; ``Relay`` (gateway/proxy/relays.py) sends
that answer on. It uses the serving process through an ``Upstream``: the
pooled client and the live state of backends, not the whole gateway.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp

from gateway.breaker import CircuitBreaker
from gateway.client import UpstreamClient, upstream_body, upstream_url
from gateway.context_limits import ContextLimits
from gateway.error_cache import ErrorCache
from gateway.fleet.scheduler import FleetScheduler, Placement
from gateway.metrics import GatewayMetrics
from gateway.proxy import checks, sse, traces
from gateway.proxy.context_shift import RequestShift, overflow_possible
from gateway.proxy.errors import ProxyError
from gateway.proxy.legs import Call, Leg, ProxyExchange, Unservable, openai_call
from gateway.proxy.outbound import OPENAI_ADAPTER, adapter_for
from gateway.proxy.relays import Relay, Send
from gateway.proxy.replies import (
    TRANSPORT_ERRORS,
    checked_reply,
    describe,
    first_events,
    first_leg_events,
    is_event_stream,
    is_leg_stream,
    leg_answer,
)
from gateway.relay.dispatch import RELAY_KIND, RelayHub, RelayRefused, relay_backend
from routing.core import LiveStats, Route, Target
from routing.core.capacity import parse_out_of_memory
from usage.limits.limiter import Limiter
from usage.live import LiveUsage

# Stream events kept to estimate tokens when a backend reports no usage; past
# this many bytes the text is counted as it passes instead.
KEEP_FOR_ESTIMATE = 256 * 1024
# Kinds that load a model when a request needs it: their 5xx may be a load
# that failed for want of memory.
LOADS_ON_REQUEST = frozenset({"ollama", "llamacpp"})


@dataclass(frozen=True, slots=True)
class Upstream:
    """What forwarding uses of the serving process (built once, by the proxy)."""

    client: UpstreamClient
    stats: LiveStats
    breaker: CircuitBreaker
    limiter: Limiter
    relay: RelayHub
    fleet: FleetScheduler
    metrics: GatewayMetrics
    live_usage: LiveUsage
    # Limits of small-context backend x model pairs seen to overflow (per process).
    context_limits: ContextLimits = field(default_factory=ContextLimits)
    # Backends a connection to which failed moments ago (the default: off).
    error_cache: ErrorCache = field(
        default_factory=lambda: ErrorCache(stats=LiveStats(), seconds=0)
    )


async def forward(
    upstream: Upstream,
    exchange: ProxyExchange,
    route: Route | Placement,
    send: Send,
) -> None:
    """Send the request to the chosen backend, retrying others before any byte.

    Retries (never the same backend twice) on connection errors, timeouts before
    the response head, 5xx answers and invalid replies (a success that is not
    the JSON the endpoint answers, a body over the size limit, a stream whose
    first event is not JSON), up to the policy's max_retries. A 4xx is the
    client's to see, and so is a 5xx the next backend repeats: that input's
    answer, suspect to both backends' breakers. Once the first byte
    went to the client, a failure ends the stream with an error event.

    ``exchange.call`` is None for an OpenAI client's request: relayed as it is
    to OpenAI-speaking backends. Any other pairing of the client's surface and
    a backend's adapter goes through a Leg (gateway/proxy/legs.py).
    """
    tries = _Tries(upstream, exchange, send)
    targets = (route.target, *route.retry_targets)
    last = len(targets) - 1
    handed = route.lease if isinstance(route, Placement) else None
    for position, target in enumerate(targets):
        if position == 1 and handed is not None:  # the first target was skipped
            _drop_lease(upstream, route.target, handed)
            handed = None
        backend = target.backend
        try:
            leg = tries.leg_for(target)
        except Unservable as error:
            tries.failures.append(f"{backend.name}: {error}")
            continue
        if not tries.may_try(target, position):
            continue
        lease, handed = handed, None  # the first target's slot, if handed over
        if lease is None and backend.max_concurrency and upstream.limiter.shared:
            # Gateway-wide: the other serving processes' requests count too.
            lease = await upstream.limiter.acquire_backend(
                backend.name, backend.capacity
            )
            if lease is None:
                upstream.stats.end(backend.name, target.model.name)
                tries.failures.append(f"{backend.name}: at max concurrency")
                continue
        if await tries.attempt(target, leg, lease, position == last):
            return
    if handed is not None:
        _drop_lease(upstream, route.target, handed)
    tries.count_held()  # no other candidate was tried after it
    tries.give_up()


class _Tries:
    """One request's way through its candidates, and what went wrong so far."""

    __slots__ = (
        "call",
        "exchange",
        "failures",
        "fault",
        "held",
        "send",
        "session",
        "shift",
        "timed_out",
        "upstream",
        "wants_usage_chunk",
    )

    def __init__(self, upstream: Upstream, exchange: ProxyExchange, send: Send) -> None:
        self.upstream = upstream
        self.exchange = exchange
        self.send = send
        self.session = upstream.client.session
        self.call: Call | None = exchange.call
        options = exchange.payload.get("stream_options")
        self.wants_usage_chunk = (
            isinstance(options, dict) and options.get("include_usage") is True
        )
        self.failures: list[str] = []
        self.timed_out = False  # the last failure was a timeout
        self.fault = ""  # the last failure was this invalid reply
        # The backend whose 5xx is not counted yet: the next candidate tells
        # whether it was the backend's (counted then) or the input's.
        self.held = ""
        self.shift = RequestShift.of(exchange, upstream.context_limits)

    def leg_for(self, target: Target) -> Leg | None:
        """Return the Leg to this backend, None for OpenAI to OpenAI as it is.

        Raises Unservable when the backend cannot take this kind of request.
        """
        adapter = adapter_for(target.backend.kind)
        call = self.call
        if call is None and adapter.protocol == OPENAI_ADAPTER.protocol:
            return None
        if call is None:
            exchange = self.exchange
            call = self.call = openai_call(
                exchange.endpoint, exchange.payload, exchange.raw
            )
        state = self.exchange.state
        breakpoints = state is not None and state.anthropic_auto_breakpoints
        return Leg(call, adapter, target, self.exchange.request_id, breakpoints)

    def may_try(self, target: Target, position: int) -> bool:
        """Count the request in flight at this backend, if it may take it."""
        backend = target.backend
        if position and self.upstream.breaker.is_open(backend.name):
            self.failures.append(f"{backend.name}: circuit open")
            return False
        if position and self.upstream.error_cache.is_cached(backend.name):
            self.failures.append(f"{backend.name}: connection failed moments ago")
            return False
        if not self.upstream.stats.try_begin(backend, target.model.name):
            self.failures.append(f"{backend.name}: at max concurrency")
            return False
        return True

    async def attempt(
        self, target: Target, leg: Leg | None, lease: str | None, is_last: bool
    ) -> bool:
        """Try one backend; True once the client has its answer.

        Ends the backend's in-flight count and gives back its slot lease in
        every outcome.
        """
        upstream, exchange, backend = self.upstream, self.exchange, target.backend
        model = target.model.name
        upstream.live_usage.touch()
        if self.failures:
            exchange.retries += 1
        response: aiohttp.ClientResponse | None = None
        shift = self.shift
        context = target.model.context_length
        trace = exchange.trace
        span = None if trace is None else traces.start_attempt(exchange, target)
        failed_before = len(self.failures)
        raised: BaseException | None = None
        try:
            if shift is not None and shift.pre_trim(backend.name, model, context):
                self.call = exchange.call
                leg = self.leg_for(target)
            while True:  # again with the request trimmed after an overflow
                url, data, headers = self._request_for(target, leg)
                if span is not None:
                    headers = traces.inject(exchange, span, headers)
                asked = time.perf_counter()
                try:
                    # The head too within the timeout, not just each read of
                    # it: a backend dripping its head a byte at a time would
                    # reset those.
                    async with asyncio.timeout(backend.request_timeout):
                        response = await self._open(target, leg, url, data, headers)
                except TRANSPORT_ERRORS as error:
                    if backend.kind != RELAY_KIND:
                        # Not there at all: new requests go elsewhere a while.
                        upstream.error_cache.connect_failed(backend.name, error)
                    self._failed(backend.name, describe(error), error)
                    return False
                upstream.stats.observe_latency(
                    backend.name, (time.perf_counter() - asked) * 1000, model
                )
                status = response.status
                error_body = None
                overflow = shift is not None and overflow_possible(status, response)
                if overflow or (status >= 500 and backend.kind in LOADS_ON_REQUEST):
                    error_body = await self._read_error_or_fail(backend, response)
                    if error_body is None:
                        return False
                    self._note_out_of_memory(target, status, error_body)
                if (
                    overflow
                    and shift is not None
                    and error_body is not None
                    and shift.after_overflow(
                        backend.kind, backend.name, model, context, status, error_body
                    )
                ):
                    response.close()
                    response = None
                    self.call = exchange.call
                    leg = self.leg_for(target)
                    continue
                break
            if shift is not None:
                shift.show(exchange.response_headers)
            if status >= 500:
                upstream.error_cache.note_failure(backend.name, f"HTTP {status}")
                if self.held:
                    # Two backends fail on this request: its input's fault as
                    # much as theirs. The client has the second's answer.
                    key = exchange.key_prefix
                    upstream.breaker.record_failure(self.held, key, suspect=True)
                    upstream.breaker.record_failure(backend.name, key, suspect=True)
                    self.held = ""
                elif not is_last:
                    # Closed below (or its pooled connection leaks).
                    self.held = backend.name
                    self.failures.append(f"{backend.name}: HTTP {status}")
                    upstream.metrics.retries.labels(backend.name).inc()
                    return False
                else:
                    upstream.breaker.record_failure(backend.name, exchange.key_prefix)
            if leg is None:
                return await self._answer(target, response, error_body)
            return await self._answer_leg(target, response, leg, error_body)
        except BaseException as error:
            raised = error
            raise
        finally:
            if span is not None:
                failure = (
                    self.failures[-1] if len(self.failures) > failed_before else ""
                )
                answer = None if response is None else response.status
                traces.end_attempt(exchange, target, span, answer, failure, raised)
            if response is not None:
                # Closed, not released, unless read to the end: a reply cut
                # short (client gone, error) must not go back to the pool.
                response.close()
            upstream.stats.end(backend.name, model)
            if not upstream.fleet.finished(backend.name, lease) and lease is not None:
                upstream.limiter.release_backend(backend.name, lease)

    def _request_for(
        self, target: Target, leg: Leg | None
    ) -> tuple[str, bytes, dict[str, str]]:
        """The URL, body and headers of the request to this backend."""
        if leg is not None:
            return leg.url, leg.body, leg.headers
        exchange = self.exchange
        data = upstream_body(
            exchange.payload, exchange.raw, target, self.wants_usage_chunk
        )
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            "x-request-id": exchange.request_id,
        }
        api_key = target.backend.api_key
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        return upstream_url(target, exchange.path), data, headers

    async def _open(
        self,
        target: Target,
        leg: Leg | None,
        url: str,
        data: bytes,
        headers: dict[str, str],
    ) -> aiohttp.ClientResponse:
        """Send the request; return once the answer's head is in."""
        exchange, backend = self.exchange, target.backend
        if backend.kind == RELAY_KIND:
            path = exchange.path if leg is None else leg.path
            try:
                response = await self.upstream.relay.open(
                    target, exchange.request_id, path, data, headers, exchange.stream
                )
            except RelayRefused as refused:
                # The client's body, not any worker: its error, no breaker's.
                code = "request_too_large" if refused.status == 413 else None
                raise ProxyError(refused.status, str(refused), code=code) from None
            # Duck-typed: status, headers, content.readany()/iter_any(), close().
            return cast(aiohttp.ClientResponse, response)
        return await self.session.request(
            "POST",
            url,
            data=data,
            headers=headers,
            timeout=self.upstream.client.timeout(backend.request_timeout),
            allow_redirects=False,
        )

    async def _read_error_or_fail(
        self, backend: Any, response: aiohttp.ClientResponse
    ) -> bytes | None:
        """Read an error answer whole (a context overflow, a failed load);
        None when that failed (counted as the backend's failure)."""
        try:
            async with asyncio.timeout(backend.request_timeout):
                return await checks.read_capped(
                    response, self.upstream.client.limits.max_reply
                )
        except TRANSPORT_ERRORS as error:
            self._failed(backend.name, f"{describe(error)} mid-reply", error)
        except checks.UpstreamFault as fault:
            self._failed(backend.name, fault.detail, fault=fault.code)
        return None

    def _note_out_of_memory(self, target: Target, status: int, body: bytes) -> None:
        """A load that failed for want of memory pauses the node's cold loads
        after a repeat (routing/core/capacity.py)."""
        if status < 500:
            return
        oom = parse_out_of_memory(body)
        if oom is not None:
            self.upstream.error_cache.out_of_memory(
                target.backend, target.model.name, oom
            )

    async def _answer(
        self,
        target: Target,
        response: aiohttp.ClientResponse,
        read: bytes | None = None,
    ) -> bool:
        """Judge an OpenAI backend's answer and relay it; False if it is a fault.

        A whole reply (or a stream's first event) is read and checked before
        anything goes to the client, so a backend that fails or answers
        nonsense can still be retried.
        """
        exchange, limits = self.exchange, self.upstream.client.limits
        backend = target.backend
        relay: sse.StreamRelay | None = None
        first = body = b""
        reply: dict[str, Any] | None = None
        try:
            async with asyncio.timeout(backend.request_timeout):
                if read is not None:
                    body = read
                    reply = checked_reply(exchange, response.status, body)
                elif is_event_stream(exchange, response):
                    relay = sse.StreamRelay(
                        self.wants_usage_chunk, KEEP_FOR_ESTIMATE, limits.max_event
                    )
                    first = await first_events(response, relay, limits.max_event)
                else:
                    body = await checks.read_capped(response, limits.max_reply)
                    reply = checked_reply(exchange, response.status, body)
        except TRANSPORT_ERRORS as error:
            self._failed(backend.name, f"{describe(error)} mid-reply", error)
            return False
        except checks.UpstreamFault as fault:
            self._failed(backend.name, fault.detail, fault=fault.code)
            return False
        answer = self._answered(target, response)
        if relay is not None:
            await answer.stream(response, relay, first)
        else:
            await answer.body(response, body, reply)
        return True

    async def _answer_leg(
        self,
        target: Target,
        response: aiohttp.ClientResponse,
        leg: Leg,
        read: bytes | None = None,
    ) -> bool:
        """Judge a leg's answer and relay it; False if it is a fault."""
        exchange, limits = self.exchange, self.upstream.client.limits
        backend = target.backend
        stream = None
        first_pieces: list[tuple[bytes, int]] = []
        body = b""
        try:
            async with asyncio.timeout(backend.request_timeout):
                if read is not None:
                    body = leg_answer(exchange, leg, response.status, response, read)
                elif is_leg_stream(exchange, response, leg):
                    stream = leg.stream(limits.max_event, exchange.cache)
                    first_pieces = await first_leg_events(
                        response,
                        stream,
                        leg.call.surface.is_ndjson,
                        exchange.meter is not None,
                    )
                else:
                    body = await checks.read_capped(response, limits.max_reply)
                    body = leg_answer(exchange, leg, response.status, response, body)
        except TRANSPORT_ERRORS as error:
            self._failed(backend.name, f"{describe(error)} mid-reply", error)
            return False
        except checks.UpstreamFault as fault:
            self._failed(backend.name, fault.detail, fault=fault.code)
            return False
        answer = self._answered(target, response)
        if stream is not None:
            await answer.leg_stream(response, leg, stream, first_pieces)
        else:
            await answer.leg_body(response.status, body)
        return True

    def _answered(self, target: Target, response: aiohttp.ClientResponse) -> Relay:
        """Note the backend that answers (health, the exchange, the headers)."""
        upstream, exchange = self.upstream, self.exchange
        backend, model = target.backend, target.model.name
        status = response.status
        if status < 500:
            self.count_held()
            upstream.breaker.record_success(backend.name, exchange.key_prefix)
            upstream.error_cache.record_success(backend.name)
        if status < 400:  # it answered for the model: loaded now (fleet)
            upstream.stats.mark_hot(backend.name, model)
        # A relay request may have been requeued to another worker.
        served_by = relay_backend(response) or backend.name
        exchange.backend = served_by
        exchange.served_model = model
        if exchange.meter is not None:
            exchange.meter.use_model(model)
        exchange.response_headers += (
            (b"x-nexus-backend", served_by.encode()),
            (b"x-nexus-model", model.encode()),
        )
        return Relay(
            exchange, self.send, backend.request_timeout, upstream.client.limits
        )

    def _failed(
        self,
        backend_name: str,
        detail: str,
        error: BaseException | None = None,
        fault: str = "",
    ) -> None:
        """Count a try that failed before any byte reached the client."""
        self.count_held()
        self.upstream.breaker.record_failure(backend_name, self.exchange.key_prefix)
        self.upstream.error_cache.note_failure(backend_name, detail, error)
        self.upstream.metrics.retries.labels(backend_name).inc()
        self.failures.append(f"{backend_name}: {detail}")
        self.timed_out = isinstance(error, TimeoutError)
        self.fault = fault

    def count_held(self) -> None:
        """Count the held 5xx: the next candidate did not repeat it."""
        if self.held:
            held, self.held = self.held, ""
            self.upstream.breaker.record_failure(held, self.exchange.key_prefix)

    def give_up(self) -> None:
        """Raise the client's error once no candidate gave an answer."""
        failures, requested = self.failures, self.exchange.requested_model
        detail = "; ".join(failures) or "no backend could be tried"
        if failures and all("max concurrency" in f for f in failures):
            raise ProxyError(
                503,
                f"Every backend for model '{requested}' is at its "
                f"concurrency limit ({detail}). Retry shortly.",
                error_type="server_error",
                code="backends_busy",
            )
        if failures and all(" serves " in f for f in failures):
            raise ProxyError(
                501,
                f"Model '{requested}' is only served by backends that "
                f"cannot take this kind of request ({detail}).",
                error_type="server_error",
                code="not_implemented",
            )
        if self.fault:
            raise ProxyError(
                502,
                f"No backend gave a valid answer for model '{requested}': {detail}.",
                error_type="server_error",
                code=self.fault,
            )
        raise ProxyError(
            504 if self.timed_out else 502,
            f"No backend answered for model '{requested}': {detail}.",
            error_type="server_error",
            code="upstream_timeout" if self.timed_out else "upstream_unavailable",
        )


def _drop_lease(upstream: Upstream, target: Target, lease: str) -> None:
    """Give back a slot lease handed over for a target that was not tried."""
    name = target.backend.name
    if not upstream.fleet.finished(name, lease):
        upstream.limiter.release_backend(name, lease)
