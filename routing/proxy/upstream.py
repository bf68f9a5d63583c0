"""Talking to backends: the pooled client, retries, relaying replies as they come.

One ``aiohttp.ClientSession`` per serving process (opened by the gateway on
its event loop) carries every upstream request, so connections are pooled and
nothing is constructed per request. httpx stays the client everywhere off the
hot path; its request layer measured a third of the gateway's throughput here.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from routing.core import LiveStats, Route, Target
from routing.proxy import sse
from routing.proxy.errors import ProxyError

if TYPE_CHECKING:
    from routing.gateway import Gateway
    from routing.proxy.limits import BudgetMeter

Send = Callable[[dict[str, Any]], Awaitable[None]]

_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')
_DECODER = json.JSONDecoder()
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
    # Set for a budgeted stream: counts it as it goes and may cut it short.
    meter: BudgetMeter | None = None


class UpstreamClient:
    """The serving process's pooled HTTP client, bound to one event loop."""

    def __init__(self, *, max_connections: int, connect_timeout: float) -> None:
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
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
    return "transport error"


_TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


async def forward(
    gateway: Gateway,
    exchange: Exchange,
    route: Route,
    payload: dict[str, Any],
    raw: bytes,
    send: Send,
    response_headers: list[tuple[bytes, bytes]],
) -> None:
    """Send the request to the chosen backend, retrying others before any byte.

    Retries (never the same backend twice) on connection errors, timeouts before
    the response head, and 5xx answers, up to the policy's max_retries. A 4xx is
    the client's to see. Once the first byte went to the client, a failure ends
    the stream with an error event.
    """
    options = payload.get("stream_options")
    wants_usage_chunk = (
        isinstance(options, dict) and options.get("include_usage") is True
    )
    stats: LiveStats = gateway.stats
    breaker = gateway.breaker
    client = gateway.upstream
    session = client.session
    targets = (route.target, *route.retry_targets)
    failures: list[str] = []
    last_timeout = False
    for position, target in enumerate(targets):
        backend = target.backend
        model = target.model.name
        if backend.kind == "anthropic":
            failures.append(
                f"{backend.name}: Anthropic backends take no OpenAI requests yet"
            )
            continue
        if position and breaker.is_open(backend.name):
            failures.append(f"{backend.name}: circuit open")
            continue
        if not stats.try_begin(backend, model):
            failures.append(f"{backend.name}: at max concurrency")
            continue
        lease: str | None = None
        if backend.max_concurrency and gateway.limiter.shared:
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
            headers = {
                "content-type": "application/json",
                "accept-encoding": "identity",
                "x-request-id": exchange.request_id,
            }
            if backend.api_key:
                headers["authorization"] = f"Bearer {backend.api_key}"
            asked = time.perf_counter()
            try:
                response = await session.request(
                    "POST",
                    upstream_url(target, exchange.path),
                    data=upstream_body(payload, raw, target, wants_usage_chunk),
                    headers=headers,
                    timeout=client.timeout(backend.request_timeout),
                    allow_redirects=False,
                )
            except _TRANSPORT_ERRORS as error:
                breaker.record_failure(backend.name)
                gateway.metrics.retries.labels(backend.name).inc()
                failures.append(f"{backend.name}: {_describe(error)}")
                last_timeout = isinstance(error, TimeoutError)
                continue
            stats.observe_latency(backend.name, (time.perf_counter() - asked) * 1000)
            status = response.status
            if status >= 500:
                breaker.record_failure(backend.name)
            else:
                breaker.record_success(backend.name)
            is_last = position == len(targets) - 1
            if status >= 500 and not is_last:
                failures.append(f"{backend.name}: HTTP {status}")
                gateway.metrics.retries.labels(backend.name).inc()
                response.close()  # or its pooled connection leaks
                response = None
                continue
            streams = _is_event_stream(exchange, response)
            if not streams:
                # A whole reply is read before anything goes to the client, so a
                # backend that fails half-way through it can still be retried.
                try:
                    body = await response.read()
                except _TRANSPORT_ERRORS as error:
                    breaker.record_failure(backend.name)
                    gateway.metrics.retries.labels(backend.name).inc()
                    failures.append(f"{backend.name}: {_describe(error)} mid-reply")
                    last_timeout = isinstance(error, TimeoutError)
                    response.close()
                    response = None
                    continue
            exchange.backend = backend.name
            exchange.served_model = model
            response_headers += (
                (b"x-nexus-backend", backend.name.encode()),
                (b"x-nexus-model", model.encode()),
            )
            if streams:
                await _relay_stream(
                    exchange, response, send, response_headers, wants_usage_chunk
                )
            else:
                await _relay_body(exchange, response, body, send, response_headers)
            return
        finally:
            if response is not None:
                # Closed, not released, unless read to the end: a reply cut
                # short (client gone, error) must not go back to the pool.
                response.close()
            stats.end(backend.name, model)
            if lease is not None:
                gateway.limiter.release_backend(backend.name, lease)
    _raise_exhausted(exchange, failures, last_timeout)


def _raise_exhausted(exchange: Exchange, failures: list[str], timeout: bool) -> None:
    detail = "; ".join(failures) or "no backend could be tried"
    if failures and all("max concurrency" in f for f in failures):
        raise ProxyError(
            503,
            f"Every backend for model '{exchange.requested_model}' is at its "
            f"concurrency limit ({detail}). Retry shortly.",
            error_type="server_error",
            code="backends_busy",
        )
    if failures and all("Anthropic" in f for f in failures):
        raise ProxyError(
            501,
            f"Model '{exchange.requested_model}' is only served by Anthropic "
            f"backends, which do not take OpenAI-format requests yet ({detail}).",
            error_type="server_error",
            code="not_implemented",
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


async def _relay_body(
    exchange: Exchange,
    response: aiohttp.ClientResponse,
    body: bytes,
    send: Send,
    headers: list[tuple[bytes, bytes]],
) -> None:
    status = exchange.status = response.status
    if status < 300:
        exchange.usage = _usage_of_body(body)
        if exchange.usage is None:
            exchange.completion_chars = _text_length(body)
    else:
        exchange.error = f"upstream_{status}"
    content_type = response.headers.get("Content-Type", "application/json")
    exchange.first_byte = time.perf_counter()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode("latin-1")),
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
    wants_usage_chunk: bool,
) -> None:
    exchange.status = response.status
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": [*_STREAM_HEADERS, *headers],
        }
    )
    relay = sse.StreamRelay(wants_usage_chunk, _KEEP_FOR_ESTIMATE)
    meter = exchange.meter
    tail = b""
    try:
        async for data in response.content.iter_any():
            out = relay.feed(data)
            goes_on = True
            if out and meter is not None:
                # Cut after the event that crossed the budget; billed for
                # everything relayed, that event included.
                out, goes_on = await meter.take(out)
            if out:
                if exchange.first_byte is None:
                    exchange.first_byte = time.perf_counter()
                await send(
                    {"type": "http.response.body", "body": out, "more_body": True}
                )
            if not goes_on:
                exchange.error = "budget_exceeded"
                exchange.completion_chars = meter.chars if meter else 0
                tail = meter.cut_event() if meter else b""
                break
        else:
            tail = relay.rest()
    except _TRANSPORT_ERRORS as error:
        exchange.error = "upstream_stream_broken"
        message = (
            f"Backend '{exchange.backend}' failed mid-stream ({_describe(error)}); "
            "the response is incomplete."
        )
        tail = sse.error_event(message, "upstream_stream_broken")
    finally:
        # Also when the client left mid-stream: billed for what was relayed.
        # A stream cut for its budget is billed as its meter counted it (a
        # usage block read with the last events was not relayed).
        if exchange.error != "budget_exceeded":
            exchange.usage = relay.usage
            if relay.usage is None:
                exchange.completion_chars = relay.text_length()
    await send({"type": "http.response.body", "body": tail, "more_body": False})


def _usage_of_body(body: bytes) -> dict[str, Any] | None:
    """Find the usage block without parsing a whole (possibly huge) reply."""
    start = body.rfind(b'"usage"')  # the reply's own usage block is its last one
    match = _USAGE_KEY.match(body, start) if start >= 0 else None
    if match is None:
        return None
    try:
        usage, _ = _DECODER.raw_decode(body[match.end() - 1 :].decode(errors="replace"))
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


def _text_length(body: bytes) -> int:
    try:
        payload = json.loads(body)
    except ValueError:
        return 0
    total = 0
    for choice in payload.get("choices") or () if isinstance(payload, dict) else ():
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        text = (
            message.get("content") if isinstance(message, dict) else choice.get("text")
        )
        if isinstance(text, str):
            total += len(text)
    return total
