"""Prometheus metrics of the gateway, and the /metrics endpoint that serves them.

The request path touches only cached metric children (no ``labels()`` lookup,
no I/O beyond prometheus-client's own value update); gauges (in flight, health,
buffer depth) are set from the gateway's state by a periodic task and when
scraped. Label values are bounded by the configuration: a model that is
neither served nor an alias is counted as "unknown", so clients cannot grow
the series without limit.

Several serving processes on one port (``nexus_run --workers N``) share one
view through prometheus-client's multiprocess mode: the launcher sets
``PROMETHEUS_MULTIPROC_DIR`` for its children, each process writes its values
there, and whichever process answers a scrape sums them all. A single process
started on its own (``daphne nexus_site.asgi:application``) keeps its metrics
in memory.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import multiprocess as prometheus_multiprocess

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Send = Callable[[dict[str, Any]], Awaitable[None]]

UNKNOWN = "unknown"
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
TTFB_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0,
)  # fmt: skip


def is_multiprocess() -> bool:
    """Whether this process shares its metrics with siblings through files."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class GatewayMetrics:
    """The metrics of one serving process (a registry of its own)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "nexus_requests",
            "Gateway requests answered, by surface, model, backend and status.",
            ("surface", "model", "backend", "status"),
            registry=registry,
        )
        self.duration = Histogram(
            "nexus_request_duration_seconds",
            "Time from receiving a request to its last byte sent.",
            ("surface", "model"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttfb = Histogram(
            "nexus_time_to_first_byte_seconds",
            "Time from receiving a request to the first byte of its answer.",
            ("surface", "model"),
            buckets=TTFB_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "nexus_tokens",
            "Tokens processed, by model, backend and direction (in or out).",
            ("model", "backend", "direction"),
            registry=registry,
        )
        self.retries = Counter(
            "nexus_upstream_retries",
            "Upstream attempts that failed before the first byte and moved on.",
            ("backend",),
            registry=registry,
        )
        self.breaker_openings = Counter(
            "nexus_breaker_openings",
            "Circuit-breaker openings decided by this gateway.",
            ("backend",),
            registry=registry,
        )
        self.in_flight = Gauge(
            "nexus_in_flight_requests",
            "Requests in flight to each backend.",
            ("backend",),
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.backend_up = Gauge(
            "nexus_backend_up",
            "1 if the backend takes traffic (enabled, healthy, circuit closed).",
            ("backend",),
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.buffered_events = Gauge(
            "nexus_usage_buffer_events",
            "Usage events held in memory, not yet handed on.",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.dropped_events = Counter(
            "nexus_usage_events_dropped",
            "Usage events dropped because the buffer was full.",
            registry=registry,
        )
        self.config_version = Gauge(
            "nexus_config_version",
            "The routing configuration version this process routes with.",
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.limited = Counter(
            "nexus_requests_limited",
            "Requests refused by a key's limits, by reason: requests, tokens, "
            "concurrency, budget, unavailable (limiter down, fail closed), "
            "model_not_allowed, expired.",
            ("reason",),
            registry=registry,
        )
        self.budget_cutoffs = Counter(
            "nexus_budget_cutoffs",
            "Streams cut off mid-answer because the key's budget ran out.",
            registry=registry,
        )
        self.limiter_errors = Counter(
            "nexus_limiter_errors",
            "Limiter calls that failed because Redis could not be reached.",
            registry=registry,
        )
        self.key_spend = Counter(
            "nexus_key_spend_usd",
            "Spend per client key (USD at the model prices), labelled by key "
            "prefix: one series per key an operator created, so bounded.",
            ("key",),
            registry=registry,
        )
        self._limited_children: dict[str, Any] = {}
        self._spend_children: dict[str, Any] = {}
        self._request_children: dict[tuple[str, str, str, int], Any] = {}
        self._latency_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._token_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._dropped_seen = 0

    def observe_request(
        self,
        surface: str,
        model: str,
        backend: str,
        status: int,
        duration: float,
        ttfb: float | None,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """Count one finished request (label values must be bounded)."""
        key = (surface, model, backend, status)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self.requests.labels(
                surface, model, backend, str(status)
            )
        counter.inc()
        latency = self._latency_children.get((surface, model))
        if latency is None:
            latency = self._latency_children[(surface, model)] = (
                self.duration.labels(surface, model),
                self.ttfb.labels(surface, model),
            )
        latency[0].observe(duration)
        if ttfb is not None:
            latency[1].observe(ttfb)
        if backend and (prompt_tokens or completion_tokens):
            tokens = self._token_children.get((model, backend))
            if tokens is None:
                tokens = self._token_children[(model, backend)] = (
                    self.tokens.labels(model, backend, "in"),
                    self.tokens.labels(model, backend, "out"),
                )
            tokens[0].inc(prompt_tokens)
            tokens[1].inc(completion_tokens)

    def count_limited(self, reason: str) -> None:
        """Count a refused request (reason from a fixed set)."""
        child = self._limited_children.get(reason)
        if child is None:
            child = self._limited_children[reason] = self.limited.labels(reason)
        child.inc()

    def observe_spend(self, key: str, nanos: int) -> None:
        """Add a request's cost to its key (a key prefix, or "" without one)."""
        child = self._spend_children.get(key)
        if child is None:
            child = self._spend_children[key] = self.key_spend.labels(
                key or "anonymous"
            )
        child.inc(nanos / 1e9)

    def set_backends(
        self, in_flight: dict[str, int], up: Iterable[tuple[str, bool]]
    ) -> None:
        """Set the per-backend gauges (periodically, off the request path)."""
        for name, is_up in up:
            self.backend_up.labels(name).set(1 if is_up else 0)
            self.in_flight.labels(name).set(in_flight.get(name, 0))

    def set_usage_buffer(self, depth: int, dropped_total: int) -> None:
        self.buffered_events.set(depth)
        if dropped_total > self._dropped_seen:
            self.dropped_events.inc(dropped_total - self._dropped_seen)
        self._dropped_seen = dropped_total

    def render(self) -> bytes:
        """The Prometheus text of this process, or of every sibling process."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not directory:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        prometheus_multiprocess.MultiProcessCollector(merged, path=directory)
        return generate_latest(merged)


def parse_networks(values: Iterable[str | Network]) -> tuple[Network, ...]:
    """Parse CIDR strings or networks (a bad one raises ValueError)."""
    return tuple(
        ipaddress.ip_network(str(value).strip(), strict=False) for value in values
    )


class MetricsEndpoint:
    """``GET /metrics`` for the networks (or the bearer token) allowed to read it."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        refresh: Callable[[], None],
        allow: tuple[Network, ...],
        token: str = "",
    ) -> None:
        self.metrics = metrics
        self.refresh = refresh
        self.allow = allow
        self.token = token.encode()

    def is_allowed(self, scope: dict[str, Any]) -> bool:
        if self.token:
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    scheme, _, given = value.partition(b" ")
                    if scheme.lower() == b"bearer" and hmac.compare_digest(
                        given.strip(), self.token
                    ):
                        return True
        client = scope.get("client")
        if not client:
            return False
        try:
            address = ipaddress.ip_address(client[0])
        except ValueError:
            return False
        return any(address in network for network in self.allow)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["method"] not in ("GET", "HEAD"):
            await _send_text(send, 405, b"Use GET.\n", (b"allow", b"GET"))
            return
        if not self.is_allowed(scope):
            await _send_text(
                send,
                403,
                b"Metrics are readable from the networks in NEXUS_METRICS_ALLOW, "
                b"or with 'Authorization: Bearer <NEXUS_METRICS_TOKEN>'.\n",
            )
            return
        self.refresh()
        body = await asyncio.to_thread(self.metrics.render)
        await _send_text(send, 200, body, content_type=CONTENT_TYPE_LATEST.encode())


async def _send_text(
    send: Send,
    status: int,
    body: bytes,
    *extra: tuple[bytes, bytes],
    content_type: bytes = b"text/plain; charset=utf-8",
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
