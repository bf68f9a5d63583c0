"""Talking to backends: the shared client, retries, relaying replies as they come.

One ``httpx.AsyncClient`` per process (per event loop) carries every upstream
request, so connections are pooled and nothing is constructed per request.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from django.conf import settings

from backends.breaker import breaker
from routing.core import LiveStats, Route, Target
from routing.proxy import sse
from routing.proxy.errors import ProxyError
from usage.live import live_usage

Send = Callable[[dict[str, Any]], Awaitable[None]]

_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')
_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class Exchange:
    """What the proxy learns about one client request while serving it."""

    request_id: str
    endpoint: str
    path: str
    requested_model: str
    stream: bool
    started: float = field(default_factory=time.perf_counter)
    backend: str = ""
    served_model: str = ""
    status: int = 0
    usage: dict[str, Any] | None = None
    completion_chars: int = 0
    error: str = ""
    client_gone: bool = False


class UpstreamClient:
    """The process's pooled HTTP client, bound to the event loop that uses it."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = httpx.AsyncClient(
                limits=httpx.Limits(
                    max_connections=settings.NEXUS_UPSTREAM_MAX_CONNECTIONS,
                    max_keepalive_connections=settings.NEXUS_UPSTREAM_MAX_KEEPALIVE,
                ),
                # The environment's proxy settings are for people, not for
                # backends on a private network.
                trust_env=False,
                follow_redirects=False,
            )
            self._loop = loop
        return self._client


client = UpstreamClient()


def upstream_url(target: Target, path: str) -> str:
    return target.backend.base_url.removesuffix("/v1") + path


def _upstream_body(
    payload: dict[str, Any], raw: bytes, target: Target, wants_usage_chunk: bool
) -> bytes:
    """The body to send: the client's bytes unless the model or usage must change."""
    rewrite: dict[str, Any] = {}
    if payload.get("model") != target.model.name:
        rewrite["model"] = target.model.name
    if payload.get("stream") is True and not wants_usage_chunk:
        options = payload.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        options["include_usage"] = True
        rewrite["stream_options"] = options
    if not rewrite:
        return raw
    return json.dumps({**payload, **rewrite}, separators=(",", ":")).encode()


def _describe(error: Exception) -> str:
    if isinstance(error, httpx.TimeoutException):
        return "timed out"
    if isinstance(error, httpx.ConnectError):
        return "connection failed"
    if isinstance(error, httpx.RemoteProtocolError):
        return "closed the connection"
    return "transport error"


async def forward(
    exchange: Exchange,
    route: Route,
    payload: dict[str, Any],
    raw: bytes,
    send: Send,
    stats: LiveStats,
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
    targets = (route.target, *route.retry_targets)
    failures: list[str] = []
    last_timeout = False
    for position, target in enumerate(targets):
        backend = target.backend
        if backend.kind == "anthropic":
            failures.append(
                f"{backend.name}: Anthropic backends take no OpenAI requests yet"
            )
            continue
        if position and breaker.is_open(backend.name):
            failures.append(f"{backend.name}: circuit open")
            continue
        if not stats.try_begin(backend):
            failures.append(f"{backend.name}: at max concurrency")
            continue
        live_usage.begin(backend.name, target.model.name)
        try:
            request = client.get().build_request(
                "POST",
                upstream_url(target, exchange.path),
                content=_upstream_body(payload, raw, target, wants_usage_chunk),
                headers=_upstream_headers(exchange, backend.api_key),
                timeout=httpx.Timeout(
                    backend.request_timeout,
                    connect=settings.NEXUS_UPSTREAM_CONNECT_TIMEOUT,
                    pool=settings.NEXUS_UPSTREAM_CONNECT_TIMEOUT,
                ),
            )
            asked = time.perf_counter()
            try:
                response = await client.get().send(request, stream=True)
            except httpx.TransportError as error:
                breaker.record_failure(backend.name)
                failures.append(f"{backend.name}: {_describe(error)}")
                last_timeout = isinstance(error, httpx.TimeoutException)
                continue
            stats.observe_latency(backend.name, (time.perf_counter() - asked) * 1000)
            if response.status_code >= 500:
                breaker.record_failure(backend.name)
            else:
                breaker.record_success(backend.name)
            try:
                is_last = position == len(targets) - 1
                if response.status_code >= 500 and not is_last:
                    failures.append(f"{backend.name}: HTTP {response.status_code}")
                    await response.aclose()  # or its pooled connection leaks
                    continue
                streams = _is_event_stream(exchange, response)
                # A whole reply is read before anything goes to the client, so a
                # backend that fails half-way through it can still be retried.
                body = b"" if streams else await response.aread()
            except httpx.TransportError as error:
                breaker.record_failure(backend.name)
                failures.append(f"{backend.name}: {_describe(error)} mid-reply")
                last_timeout = isinstance(error, httpx.TimeoutException)
                await response.aclose()
                continue
            except BaseException:
                await response.aclose()
                raise
            exchange.backend = backend.name
            exchange.served_model = target.model.name
            response_headers += (
                (b"x-nexus-backend", backend.name.encode()),
                (b"x-nexus-model", target.model.name.encode()),
            )
            try:
                if streams:
                    await _relay_stream(
                        exchange, response, send, response_headers, wants_usage_chunk
                    )
                else:
                    await _relay_body(exchange, response, body, send, response_headers)
            finally:
                await response.aclose()
            return
        finally:
            stats.end(backend.name)
            live_usage.end(backend.name, target.model.name)
    _raise_exhausted(exchange, failures, last_timeout)


def _upstream_headers(exchange: Exchange, api_key: str) -> list[tuple[str, str]]:
    headers = [
        ("content-type", "application/json"),
        ("accept-encoding", "identity"),
        ("x-request-id", exchange.request_id),
    ]
    if api_key:
        headers.append(("authorization", f"Bearer {api_key}"))
    return headers


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


def _is_event_stream(exchange: Exchange, response: httpx.Response) -> bool:
    return (
        exchange.stream
        and response.status_code < 300
        and "event-stream" in response.headers.get("content-type", "")
    )


async def _relay_body(
    exchange: Exchange,
    response: httpx.Response,
    body: bytes,
    send: Send,
    headers: list[tuple[bytes, bytes]],
) -> None:
    exchange.status = response.status_code
    if response.status_code < 300:
        exchange.usage = _usage_of_body(body)
        if exchange.usage is None:
            exchange.completion_chars = _text_length(body)
    else:
        exchange.error = f"upstream_{response.status_code}"
    content_type = response.headers.get("content-type", "application/json")
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _relay_stream(
    exchange: Exchange,
    response: httpx.Response,
    send: Send,
    headers: list[tuple[bytes, bytes]],
    wants_usage_chunk: bool,
) -> None:
    exchange.status = response.status_code
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
                *headers,
            ],
        }
    )
    splitter = sse.EventSplitter()
    seen: list[bytes] = []  # kept to estimate tokens if no usage ever arrives
    try:
        async for data in response.aiter_raw():
            out: list[bytes] = []
            for event in splitter.feed(data):
                usage = sse.usage_of_event(event)
                if usage is not None:
                    exchange.usage = usage
                    if not wants_usage_chunk and sse.is_usage_only(event):
                        continue
                seen.append(event)
                out.append(event)
            if out:
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"".join(out),
                        "more_body": True,
                    }
                )
    except httpx.HTTPError as error:
        exchange.error = "upstream_stream_broken"
        message = (
            f"Backend '{exchange.backend}' failed mid-stream ({_describe(error)}); "
            "the response is incomplete."
        )
        tail = sse.error_event(message, "upstream_stream_broken")
    else:
        tail = splitter.rest()
    if exchange.usage is None:
        exchange.completion_chars = sse.text_of_events(seen)
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
