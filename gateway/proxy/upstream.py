"""Talking to backends: the pooled client, retries, relaying replies as they come.

One ``aiohttp.ClientSession`` per serving process (opened by the gateway on
its event loop) carries every upstream request, so connections are pooled and
nothing is constructed per request. httpx stays the client everywhere off the
hot path; its request layer measured a third of the gateway's throughput here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from gateway.fleet.scheduler import Placement
from gateway.protocols.base import BUDGET, StreamFailed
from gateway.proxy import checks, sse
from gateway.proxy.errors import ProxyError
from gateway.proxy.legs import Call, Leg, LegStream, Unservable, openai_call
from gateway.proxy.outbound import OPENAI_ADAPTER, adapter_for
from gateway.relay.dispatch import (
    RELAY_KIND,
    RelayUnavailable,
    open_relay,
    relay_backend,
)
from routing.core import LiveStats, Route, Target

if TYPE_CHECKING:
    from gateway.process import Gateway
    from gateway.proxy.limits import BudgetMeter
    from usage.limits.limiter import Ticket

Send = Callable[[dict[str, Any]], Awaitable[None]]

_STREAM_OPTIONS = b',"stream_options":{"include_usage":true}}'
# Stream events kept to estimate tokens when a backend reports no usage; past
# this many bytes the text is counted as it passes instead.
_KEEP_FOR_ESTIMATE = 256 * 1024


@dataclass(slots=True)
class Exchange:
    """What the proxy learns about one client request while serving it."""

    request_id: str
    endpoint: str
    path: str
    requested_model: str
    stream: bool
    started: float = field(default_factory=time.perf_counter)
    first_byte: float | None = None  # perf_counter() when the answer began
    backend: str = ""
    served_model: str = ""
    status: int = 0
    usage: dict[str, Any] | None = None
    completion_chars: int = 0
    error: str = ""
    client_gone: bool = False
    retries: int = 0
    # Bytes sent that the client has not read yet, where the server tells
    # (Daphne, through nexus_site.servers.daphne_limits); None elsewhere.
    unsent_bytes: Callable[[], int] | None = None
    # What the key's limits took for this request (settled with its usage).
    limit_ticket: Ticket | None = None
    # Set for a budgeted stream: counts it as it goes and may cut it short.
    meter: BudgetMeter | None = None


class UpstreamClient:
    """The serving process's pooled HTTP client, bound to one event loop."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout: float,
        limits: ReplyLimits | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.limits = limits or ReplyLimits()
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def open(self) -> None:
        """Create the session on the running loop (at start-up, not per request)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self.max_connections,
                limit_per_host=0,
                ttl_dns_cache=60,
                enable_cleanup_closed=True,
            ),
            # The environment's proxy settings are for people, not for
            # backends on a private network.
            trust_env=False,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None:
            raise RuntimeError("The upstream client is not open (gateway not started)")
        return session

    def timeout(self, request_timeout: float) -> aiohttp.ClientTimeout:
        """Connect (incl. waiting for a pooled connection) and per-read limits."""
        timeout = self._timeouts.get(request_timeout)
        if timeout is None:
            timeout = self._timeouts[request_timeout] = aiohttp.ClientTimeout(
                total=None,
                connect=self.connect_timeout,
                sock_connect=self.connect_timeout,
                sock_read=request_timeout,
            )
        return timeout


def upstream_url(target: Target, path: str) -> str:
    return target.backend.base_url.removesuffix("/v1") + path


def upstream_body(
    payload: dict[str, Any], raw: bytes, target: Target, wants_usage_chunk: bool
) -> bytes:
    """The body to send: the client's bytes unless the model or usage must change.

    Asking a stream for its usage block (when the client did not) appends the
    option to the client's bytes instead of serialising the body again.
    """
    same_model = payload.get("model") == target.model.name
    add_usage = payload.get("stream") is True and not wants_usage_chunk
    if same_model and not add_usage:
        return raw
    if same_model and "stream_options" not in payload:
        end = raw.rfind(b"}")  # the object's own closing brace: only space follows
        return raw[:end] + _STREAM_OPTIONS
    rewrite: dict[str, Any] = {"model": target.model.name}
    if add_usage:
        options = payload.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        options["include_usage"] = True
        rewrite["stream_options"] = options
    return json.dumps({**payload, **rewrite}, separators=(",", ":")).encode()


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, aiohttp.ClientConnectorError):
        return "connection failed"
    if isinstance(error, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "closed the connection"
    if isinstance(error, RelayUnavailable):
        return f"no relay worker took it ({error})"
    return "transport error"


_TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


@dataclass(frozen=True, slots=True)
class ReplyLimits:
    """How much of an upstream reply, and of a slow reader, the proxy accepts."""

    max_reply: int = 32 * 1024 * 1024  # non-stream body
    max_event: int = 1024 * 1024  # one SSE event
    max_unsent: int = 8 * 1024 * 1024  # stream bytes the client has not read


async def forward(
    gateway: Gateway,
    exchange: Exchange,
    route: Route | Placement,
    payload: dict[str, Any],
    raw: bytes,
    send: Send,
    response_headers: list[tuple[bytes, bytes]],
    call: Call | None = None,
) -> None:
    """Send the request to the chosen backend, retrying others before any byte.

    Retries (never the same backend twice) on connection errors, timeouts before
    the response head, 5xx answers and invalid replies (a success that is not
    the JSON the endpoint answers, a body over the size limit, a stream whose
    first event is not JSON), up to the policy's max_retries. A 4xx is the
    client's to see. Once the first byte went to the client, a failure ends
    the stream with an error event.

    ``call`` is None for an OpenAI client's request: relayed as it is to
    OpenAI-speaking backends. Any other pairing of the client's surface and a
    backend's adapter goes through a Leg (gateway/proxy/legs.py).
    """
    options = payload.get("stream_options")
    wants_usage_chunk = (
        isinstance(options, dict) and options.get("include_usage") is True
    )
    stats: LiveStats = gateway.stats
    breaker = gateway.breaker
    client = gateway.upstream
    limits = client.limits
    session = client.session
    targets = (route.target, *route.retry_targets)
    failures: list[str] = []
    last_timeout = False
    last_fault = ""
    handed = route.lease if isinstance(route, Placement) else None
    for position, target in enumerate(targets):
        if position == 1 and handed is not None:  # the first target was skipped
            _drop_lease(gateway, route.target, handed)
            handed = None
        backend = target.backend
        model = target.model.name
        adapter = adapter_for(backend.kind)
        leg: Leg | None = None
        if call is not None or adapter.protocol != OPENAI_ADAPTER.protocol:
            try:
                if call is None:
                    call = openai_call(exchange.endpoint, payload, raw)
                leg = Leg(call, adapter, target, exchange.request_id)
            except Unservable as error:
                failures.append(f"{backend.name}: {error}")
                continue
        if position and breaker.is_open(backend.name):
            failures.append(f"{backend.name}: circuit open")
            continue
        if not stats.try_begin(backend, model):
            failures.append(f"{backend.name}: at max concurrency")
            continue
        lease, handed = handed, None  # the first target's slot, if handed over
        if lease is None and backend.max_concurrency and gateway.limiter.shared:
            # Gateway-wide: the other serving processes' requests count too.
            lease = await gateway.limiter.acquire_backend(
                backend.name, backend.capacity
            )
            if lease is None:
                stats.end(backend.name, model)
                failures.append(f"{backend.name}: at max concurrency")
                continue
        gateway.live_usage.touch()
        if failures:
            exchange.retries += 1
        response: aiohttp.ClientResponse | None = None
        try:
            if leg is None:
                url = upstream_url(target, exchange.path)
                data = upstream_body(payload, raw, target, wants_usage_chunk)
                headers = {
                    "content-type": "application/json",
                    "accept-encoding": "identity",
                    "x-request-id": exchange.request_id,
                }
                if backend.api_key:
                    headers["authorization"] = f"Bearer {backend.api_key}"
            else:
                url, data, headers = leg.url, leg.body, leg.headers
            asked = time.perf_counter()
            try:
                # The head too within the timeout, not just each read of it: a
                # backend dripping its head a byte at a time would reset those.
                async with asyncio.timeout(backend.request_timeout):
                    if backend.kind == RELAY_KIND:
                        path = exchange.path if leg is None else leg.path
                        response = await open_relay(
                            gateway, exchange, target, path, data, headers
                        )
                    else:
                        response = await session.request(
                            "POST",
                            url,
                            data=data,
                            headers=headers,
                            timeout=client.timeout(backend.request_timeout),
                            allow_redirects=False,
                        )
            except _TRANSPORT_ERRORS as error:
                breaker.record_failure(backend.name)
                gateway.metrics.retries.labels(backend.name).inc()
                failures.append(f"{backend.name}: {_describe(error)}")
                last_timeout = isinstance(error, TimeoutError)
                last_fault = ""
                continue
            stats.observe_latency(
                backend.name, (time.perf_counter() - asked) * 1000, model
            )
            status = response.status
            is_last = position == len(targets) - 1
            if status >= 500:
                breaker.record_failure(backend.name)
                if not is_last:
                    failures.append(f"{backend.name}: HTTP {status}")
                    gateway.metrics.retries.labels(backend.name).inc()
                    response.close()  # or its pooled connection leaks
                    response = None
                    continue
            streams = (
                _is_event_stream(exchange, response)
                if leg is None
                else _is_leg_stream(exchange, response, leg)
            )
            # A whole reply (or a stream's first event) is read and checked
            # before anything goes to the client, so a backend that fails or
            # answers nonsense can still be retried.
            try:
                async with asyncio.timeout(backend.request_timeout):
                    if streams:
                        if leg is None:
                            relay = sse.StreamRelay(
                                wants_usage_chunk, _KEEP_FOR_ESTIMATE, limits.max_event
                            )
                            first = await _first_events(
                                response, relay, limits.max_event
                            )
                        else:
                            leg_stream = leg.stream(limits.max_event)
                            first_pieces = await _first_leg_events(
                                response,
                                leg_stream,
                                leg.call.surface.is_ndjson,
                                exchange.meter is not None,
                            )
                    else:
                        body = await checks.read_capped(response, limits.max_reply)
                        if leg is None:
                            reply = _checked_reply(exchange, status, body)
                        else:
                            body = _leg_answer(exchange, leg, status, response, body)
            except _TRANSPORT_ERRORS as error:
                breaker.record_failure(backend.name)
                gateway.metrics.retries.labels(backend.name).inc()
                failures.append(f"{backend.name}: {_describe(error)} mid-reply")
                last_timeout = isinstance(error, TimeoutError)
                last_fault = ""
                response.close()
                response = None
                continue
            except checks.UpstreamFault as fault:
                breaker.record_failure(backend.name)
                gateway.metrics.retries.labels(backend.name).inc()
                failures.append(f"{backend.name}: {fault.detail}")
                last_timeout = False
                last_fault = fault.code
                response.close()  # the rest of the reply is never read
                response = None
                continue
            if status < 500:
                breaker.record_success(backend.name)
            if status < 400:  # it answered for the model: loaded now (fleet)
                stats.mark_hot(backend.name, model)
            # A relay request may have been requeued to another worker.
            served_by = relay_backend(response) or backend.name
            exchange.backend = served_by
            exchange.served_model = model
            if exchange.meter is not None:
                exchange.meter.use_model(model)
            response_headers += (
                (b"x-nexus-backend", served_by.encode()),
                (b"x-nexus-model", model.encode()),
            )
            if leg is not None:
                if streams:
                    await _relay_leg_stream(
                        exchange,
                        leg,
                        response,
                        send,
                        response_headers,
                        leg_stream,
                        first_pieces,
                        backend.request_timeout,
                        limits.max_unsent,
                    )
                else:
                    await _send_leg_body(
                        exchange, leg, status, body, send, response_headers
                    )
            elif streams:
                await _relay_stream(
                    exchange,
                    response,
                    send,
                    response_headers,
                    relay,
                    first,
                    backend.request_timeout,
                    limits.max_unsent,
                )
            else:
                await _relay_body(
                    exchange, response, body, reply, send, response_headers
                )
            return
        finally:
            if response is not None:
                # Closed, not released, unless read to the end: a reply cut
                # short (client gone, error) must not go back to the pool.
                response.close()
            stats.end(backend.name, model)
            if not gateway.fleet.finished(backend.name, lease) and lease is not None:
                gateway.limiter.release_backend(backend.name, lease)
    if handed is not None:
        _drop_lease(gateway, route.target, handed)
    _raise_exhausted(exchange, failures, last_timeout, last_fault)


def _drop_lease(gateway: Gateway, target: Target, lease: str) -> None:
    """Give back a slot lease handed over for a target that was not tried."""
    name = target.backend.name
    if not gateway.fleet.finished(name, lease):
        gateway.limiter.release_backend(name, lease)


def _raise_exhausted(
    exchange: Exchange, failures: list[str], timeout: bool, fault: str = ""
) -> None:
    detail = "; ".join(failures) or "no backend could be tried"
    if failures and all("max concurrency" in f for f in failures):
        raise ProxyError(
            503,
            f"Every backend for model '{exchange.requested_model}' is at its "
            f"concurrency limit ({detail}). Retry shortly.",
            error_type="server_error",
            code="backends_busy",
        )
    if failures and all(" serves " in f for f in failures):
        raise ProxyError(
            501,
            f"Model '{exchange.requested_model}' is only served by backends that "
            f"cannot take this kind of request ({detail}).",
            error_type="server_error",
            code="not_implemented",
        )
    if fault:
        raise ProxyError(
            502,
            f"No backend gave a valid answer for model "
            f"'{exchange.requested_model}': {detail}.",
            error_type="server_error",
            code=fault,
        )
    raise ProxyError(
        504 if timeout else 502,
        f"No backend answered for model '{exchange.requested_model}': {detail}.",
        error_type="server_error",
        code="upstream_timeout" if timeout else "upstream_unavailable",
    )


def _is_event_stream(exchange: Exchange, response: aiohttp.ClientResponse) -> bool:
    return (
        exchange.stream
        and response.status < 300
        and "event-stream" in response.headers.get("Content-Type", "")
    )


def _is_leg_stream(
    exchange: Exchange, response: aiohttp.ClientResponse, leg: Leg
) -> bool:
    content_type = response.headers.get("Content-Type", "")
    return (
        exchange.stream
        and response.status < 300
        and leg.adapter.is_stream(content_type, leg.native)
    )


def _checked_reply(
    exchange: Exchange, status: int, body: bytes
) -> dict[str, Any] | None:
    """The parsed body of a success (None for an error reply), or UpstreamFault."""
    if status >= 300:
        return None
    if exchange.stream:
        # Asked for a stream, answered something else with a success status.
        raise checks.invalid("answered a stream request without an event stream")
    return checks.check_reply_body(exchange.endpoint, body)


async def _first_events(
    response: aiohttp.ClientResponse, relay: sse.StreamRelay, max_event: int
) -> bytes:
    """Read up to the stream's first data event and check it; return what to send.

    Raises UpstreamFault when the first event is not JSON, is over the limit,
    or the stream ends before it.
    """
    sent: list[bytes] = []
    try:
        async for data in response.content.iter_any():
            out = relay.feed(data)
            if out:
                sent.append(out)
                if checks.check_first_event(out):
                    return b"".join(sent)
    except sse.EventTooLarge:
        raise checks.event_too_large(max_event) from None
    except sse.InvalidEvent as error:
        first = b"".join([*sent, error.before])
        if checks.check_first_event(first):
            # A valid first event came before it (in the same read): the stream
            # starts, and the relay ends it at the broken event, however the
            # backend's bytes were cut into reads.
            relay.broken = True
            return first
        # Nothing reached the client yet: the next candidate may do better.
        raise checks.invalid("sent a stream event that is not a JSON object") from None
    raise checks.invalid("ended its stream before the first event")


async def _relay_body(
    exchange: Exchange,
    response: aiohttp.ClientResponse,
    body: bytes,
    reply: dict[str, Any] | None,
    send: Send,
    headers: list[tuple[bytes, bytes]],
) -> None:
    status = exchange.status = response.status
    if reply is not None:
        usage = reply.get("usage")
        exchange.usage = usage if isinstance(usage, dict) else None
        if exchange.usage is None:
            exchange.completion_chars = _text_length(reply)
        content_type = b"application/json"
    else:
        body, exchange.error = checks.error_reply(
            status,
            response.headers.get("Content-Type", ""),
            body,
            exchange.backend,
            exchange.request_id,
        )
        content_type = b"application/json"
    exchange.first_byte = time.perf_counter()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


_STREAM_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


async def _relay_stream(
    exchange: Exchange,
    response: aiohttp.ClientResponse,
    send: Send,
    headers: list[tuple[bytes, bytes]],
    relay: sse.StreamRelay,
    first: bytes,
    event_timeout: float,
    max_unsent: int,
) -> None:
    """Relay the rest of a stream whose first events were read and checked.

    Ends the stream with an error event when the backend breaks, sends an
    event over the size limit, or goes `event_timeout` seconds without
    completing an event; stops reading it when the client has not read
    `max_unsent` bytes of what was sent (a stalled reader, seen where the
    server tells: ``exchange.unsent_bytes``).
    """
    exchange.status = response.status
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": [*_STREAM_HEADERS, *headers],
        }
    )
    meter = exchange.meter
    goes_on = True
    unsent = exchange.unsent_bytes
    loop = asyncio.get_running_loop()
    tail = b""
    try:
        if meter is not None:
            first, goes_on = await meter.take(sse.counted_events(first))
        exchange.first_byte = time.perf_counter()
        await send({"type": "http.response.body", "body": first, "more_body": True})
        if relay.broken:
            raise sse.InvalidEvent(b"")
        async with asyncio.timeout_at(loop.time() + event_timeout) as deadline:
            while goes_on:
                data = await response.content.readany()
                if not data:
                    tail = relay.rest()
                    break
                out = relay.feed(data)
                if out:
                    deadline.reschedule(loop.time() + event_timeout)
                    if meter is not None:
                        # Cut after the event that crossed the budget.
                        out, goes_on = await meter.take(sse.counted_events(out))
                    await send(
                        {"type": "http.response.body", "body": out, "more_body": True}
                    )
                    if unsent is not None and unsent() > max_unsent:
                        exchange.error = "client_stalled"
                        break
    except sse.EventTooLarge as error:
        exchange.error = "upstream_event_too_large"
        tail = sse.error_event(
            f"Backend '{exchange.backend}' sent a stream event over the gateway's "
            f"limit ({error.args[0]} bytes); the response is incomplete.",
            exchange.error,
        )
    except sse.InvalidEvent as error:
        # A later event the client's SDK could not parse: what came before it
        # goes out, then the error event; the caller closes the backend's
        # connection (the rest is never read).
        exchange.error = "upstream_invalid_response"
        before = error.before
        if before and meter is not None:
            before, goes_on = await meter.take(sse.counted_events(before))
        if before:
            await send(
                {"type": "http.response.body", "body": before, "more_body": True}
            )
        tail = sse.error_event(
            f"Backend '{exchange.backend}' sent a stream event that is not a JSON "
            "object; the response is incomplete.",
            exchange.error,
        )
    except _TRANSPORT_ERRORS as error:
        exchange.error = "upstream_stream_broken"
        message = (
            f"Backend '{exchange.backend}' failed mid-stream ({_describe(error)}); "
            "the response is incomplete."
        )
        tail = sse.error_event(message, "upstream_stream_broken")
    finally:
        # Also when the client left mid-stream: billed for what was relayed.
        if not goes_on:
            _cut_for_budget(exchange)
        else:
            exchange.usage = relay.usage
            if relay.usage is None:
                exchange.completion_chars = relay.text_length()
    if meter is not None and not goes_on:
        cut = meter.cut_error()
        tail = sse.error_event(cut.message, BUDGET, cut.error_type)
    await send({"type": "http.response.body", "body": tail, "more_body": False})


def _cut_for_budget(exchange: Exchange) -> None:
    """A stream cut for its key's budget is billed as its meter counted it (a
    usage block read with the last events was not relayed)."""
    exchange.error = "budget_exceeded"
    exchange.usage = None
    exchange.completion_chars = exchange.meter.chars if exchange.meter else 0


async def _send_leg_body(
    exchange: Exchange,
    leg: Leg,
    status: int,
    body: bytes,
    send: Send,
    headers: list[tuple[bytes, bytes]],
) -> None:
    exchange.status = status
    if status >= 300 and not exchange.error:
        exchange.error = f"upstream_{status}"
    exchange.first_byte = time.perf_counter()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _leg_answer(
    exchange: Exchange,
    leg: Leg,
    status: int,
    response: aiohttp.ClientResponse,
    body: bytes,
) -> bytes:
    """The client's body for a leg's whole answer, checked; or UpstreamFault.

    A backend that speaks the client's protocol has its answer passed through:
    a success must still be a JSON object, and an error that is not JSON is
    replaced (and logged) like on the OpenAI path.
    """
    if leg.native:
        if status < 300:
            if checks.json_object_of(body) is None:
                raise checks.invalid("answered a success that is not a JSON object")
        elif checks.json_object_of(body) is None:
            _, exchange.error = checks.error_reply(
                status,
                response.headers.get("Content-Type", ""),
                body,
                leg.target.backend.name,
                exchange.request_id,
            )
            return leg.call.surface.error_body(
                ProxyError(
                    status,
                    f"The backend '{leg.target.backend.name}' answered HTTP {status} "
                    "with an error the gateway does not pass on; the gateway's log "
                    f"has it (request id {exchange.request_id}).",
                    error_type="server_error" if status >= 500 else "upstream_error",
                    code="upstream_error",
                )
            )
    try:
        return leg.answer(exchange, status, body)
    except (ValueError, UnicodeDecodeError):
        raise checks.invalid("answered a success its protocol does not allow") from None


async def _first_leg_events(
    response: aiohttp.ClientResponse,
    stream: LegStream,
    ndjson: bool = False,
    counted: bool = False,
) -> list[tuple[bytes, int]]:
    """A leg's first bytes for the client, once they exist; or UpstreamFault.

    ``ndjson``: the client's stream is JSON lines (Ollama's), not SSE.
    ``counted``: cut per event with their characters of text (for a meter);
    else one piece.
    """
    check = checks.check_first_line if ndjson else checks.check_first_event
    sent: list[tuple[bytes, int]] = []
    try:
        async for data in response.content.iter_any():
            if counted:
                pieces = stream.feed_counted(data)
                out = b"".join([piece for piece, _ in pieces])
                sent += pieces
            else:
                out = stream.feed(data)
                if out:
                    sent.append((out, 0))
            if out and check(out):
                return sent
    except StreamFailed as error:
        raise checks.invalid(error.message) from None
    raise checks.invalid("ended its stream before the first event")


async def _relay_leg_stream(
    exchange: Exchange,
    leg: Leg,
    response: aiohttp.ClientResponse,
    send: Send,
    headers: list[tuple[bytes, bytes]],
    stream: LegStream,
    first_pieces: list[tuple[bytes, int]],
    event_timeout: float,
    max_unsent: int,
) -> None:
    """Relay (or translate) the rest of a leg's stream; bounded as _relay_stream."""
    exchange.status = response.status
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": [
                (b"content-type", leg.call.surface.stream_content_type),
                *_STREAM_HEADERS[1:],
                *headers,
            ],
        }
    )
    meter = exchange.meter
    goes_on = True
    unsent = exchange.unsent_bytes
    loop = asyncio.get_running_loop()
    tail = b""
    try:
        if meter is None:
            first = b"".join([piece for piece, _ in first_pieces])
        else:
            first, goes_on = await meter.take(first_pieces)
        exchange.first_byte = time.perf_counter()
        await send({"type": "http.response.body", "body": first, "more_body": True})
        async with asyncio.timeout_at(loop.time() + event_timeout) as deadline:
            while goes_on:
                data = await response.content.readany()
                if not data:
                    if meter is None:
                        tail = stream.finish()
                    else:
                        tail, goes_on = await meter.take(stream.finish_counted())
                    break
                if meter is None:
                    out = stream.feed(data)
                else:
                    out, goes_on = await meter.take(stream.feed_counted(data))
                if out:
                    deadline.reschedule(loop.time() + event_timeout)
                    await send(
                        {"type": "http.response.body", "body": out, "more_body": True}
                    )
                    if unsent is not None and unsent() > max_unsent:
                        exchange.error = "client_stalled"
                        break
    except _TRANSPORT_ERRORS as error:
        exchange.error = "upstream_stream_broken"
        tail = stream.fail(
            f"Backend '{exchange.backend}' failed mid-stream ({_describe(error)}); "
            "the response is incomplete."
        )
    except StreamFailed as error:
        exchange.error = "upstream_stream_error"
        tail = stream.fail(
            f"Backend '{exchange.backend}' failed mid-stream ({error.message}); "
            "the response is incomplete."
        )
    finally:
        # Also when the client left mid-stream: billed for what was relayed.
        if not goes_on:
            _cut_for_budget(exchange)
        else:
            exchange.usage = stream.usage
            if stream.usage is None:
                exchange.completion_chars = stream.chars
    if meter is not None and not goes_on:
        tail += stream.fail(meter.cut_error().message, BUDGET)
    await send({"type": "http.response.body", "body": tail, "more_body": False})


def _text_length(payload: dict[str, Any]) -> int:
    total = 0
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        text = (
            message.get("content") if isinstance(message, dict) else choice.get("text")
        )
        if isinstance(text, str):
            total += len(text)
    return total
