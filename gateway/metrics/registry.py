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
        self._add_admission_metrics(registry)
        self._add_fleet_metrics(registry)
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

    def _add_fleet_metrics(self, registry: CollectorRegistry) -> None:
        """The fleet scheduler's (gateway/fleet): queues, warm-ups, moves, holds."""
        self.fleet_prewarm = Counter(
            "nexus_fleet_prewarm",
            "Models loaded ahead of demand on a runner-up backend, by outcome "
            "(loaded, failed).",
            ("backend", "model", "outcome"),
            registry=registry,
        )
        self.fleet_rebalanced = Counter(
            "nexus_fleet_rebalanced",
            "Waiting requests moved to a backend where their model is hot.",
            ("source", "destination", "model"),
            registry=registry,
        )
        self.fleet_queue_waiting = Gauge(
            "nexus_fleet_queue_waiting",
            "Requests waiting for a slot, by backend and model.",
            ("backend", "model"),
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.fleet_queue_wait = Histogram(
            "nexus_fleet_queue_wait_seconds",
            "Time requests waited for a slot before running.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.fleet_queue_refusals = Counter(
            "nexus_fleet_queue_refusals",
            "Requests the fleet queues refused, by reason (queue_full, queue_timeout).",
            ("reason",),
            registry=registry,
        )
        self.fleet_held = Gauge(
            "nexus_fleet_held_requests",
            "Requests held because no backend can serve their model now.",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.fleet_hold_outcomes = Counter(
            "nexus_fleet_hold",
            "Held requests by outcome: served (a backend came back) or expired "
            "(then the fallback chain, then 503).",
            ("outcome",),
            registry=registry,
        )
        self._fleet_lines: set[tuple[str, str]] = set()

    def set_fleet_lines(self, lines: Iterable[tuple[str, str, int]]) -> None:
        """Set the waiting gauge of every line (and zero those now empty)."""
        current: set[tuple[str, str]] = set()
        for backend, model, waiting in lines:
            current.add((backend, model))
            self.fleet_queue_waiting.labels(backend, model).set(waiting)
        for backend, model in self._fleet_lines - current:
            self.fleet_queue_waiting.labels(backend, model).set(0)
        self._fleet_lines = current

    def _add_admission_metrics(self, registry: CollectorRegistry) -> None:
        self.admission_queue_length = Gauge(
            "nexus_admission_queue_length",
            "Requests waiting in the admission queue, by model and flow.",
            ("model", "flow"),
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.admission_queue_latency = Histogram(
            "nexus_admission_queue_latency_seconds",
            "Time requests spent in the admission queue; success is false for "
            "those that never reached a backend (TTL, deadline, preempted, gone).",
            ("model", "success"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.admission_stock = Gauge(
            "nexus_admission_stock_level",
            "Requests let through admission control and not yet finished.",
            ("model",),
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.admission_bypassed = Counter(
            "nexus_admission_bypass",
            "Requests that went straight through (nothing waiting, stock low).",
            ("model",),
            registry=registry,
        )
        self.admission_expired = Counter(
            "nexus_admission_requests_expired",
            "Requests that waited past the queue TTL (503 queue_ttl_expired) or "
            "their own deadline (504 deadline_exceeded), by reason.",
            ("model", "reason"),
            registry=registry,
        )
        self.admission_cancelled = Counter(
            "nexus_admission_requests_cancelled",
            "Requests whose client left while they waited (499).",
            ("model",),
            registry=registry,
        )
        self.admission_push_errors = Counter(
            "nexus_admission_queue_push_errors",
            "Requests the queue refused, by error type (queue_full: "
            "ErrTooManyFlows, flow_queue_full: ErrInsufficientFlowCapacity).",
            ("model", "error_type"),
            registry=registry,
        )
        self.admission_preemptions = Counter(
            "nexus_admission_preemptions",
            "Waiting requests shed for a more critical one, by their criticality.",
            ("criticality",),
            registry=registry,
        )
        self.admission_lower = Gauge(
            "nexus_admission_lower_bound",
            "The band's lower bound of each backend pool (whole gateway).",
            ("pool",),
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.admission_upper = Gauge(
            "nexus_admission_upper_bound",
            "The band's upper bound of each backend pool (whole gateway).",
            ("pool",),
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.admission_watermark = Gauge(
            "nexus_admission_watermark",
            "The watermark of each backend pool (whole gateway).",
            ("pool",),
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.admission_dequeue_attempts = Counter(
            "nexus_admission_dequeue_attempts",
            "Attempts to take a request from the admission queue.",
            registry=registry,
        )
        self.admission_dequeue_successes = Counter(
            "nexus_admission_dequeue_successes",
            "Requests taken from the admission queue and sent on.",
            registry=registry,
        )
        self.admission_processes = Gauge(
            "nexus_admission_serving_processes",
            "Serving processes sharing each band, as this process counts them.",
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.admission_active_flows = Gauge(
            "nexus_admission_active_flows",
            "Flows with requests waiting.",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self._bypass_children: dict[str, Any] = {}
        self._queue_length_seen: set[tuple[str, str]] = set()
        self._stock_seen: set[str] = set()

    def admission_bypass(self, model: str) -> None:
        """Count a request that went straight through (the hot path: cached)."""
        child = self._bypass_children.get(model)
        if child is None:
            child = self._bypass_children[model] = self.admission_bypassed.labels(model)
        child.inc()

    def admission_decided(self, ticket: Any) -> None:
        """Count a waiting request's outcome (a routing.admission Ticket)."""
        outcome = ticket.outcome.value if ticket.outcome is not None else ""
        model = ticket.model
        waited = (ticket.decided_at or ticket.arrived) - ticket.arrived
        success = "true" if outcome == "dispatched" else "false"
        self.admission_queue_latency.labels(model, success).observe(max(0.0, waited))
        if outcome in ("expired", "deadline"):
            self.admission_expired.labels(model, outcome).inc()
        elif outcome == "cancelled":
            self.admission_cancelled.labels(model).inc()
        elif outcome == "preempted":
            self.admission_preemptions.labels(ticket.criticality.label).inc()

    def admission_refused(self, model: str, error_type: str) -> None:
        self.admission_push_errors.labels(model, error_type).inc()

    def set_admission(
        self,
        pools: Iterable[Any],
        waiting: Iterable[Any],
        dequeue_attempts: int,
        dequeue_successes: int,
        processes: int = 1,
    ) -> None:
        """Set the admission gauges from the controller (off the request path)."""
        self.admission_processes.set(processes)
        lengths: dict[tuple[str, str], int] = {}
        for ticket in waiting:
            key = (ticket.model, ticket.flow or "-")
            lengths[key] = lengths.get(key, 0) + 1
        for key in self._queue_length_seen - lengths.keys():
            self.admission_queue_length.labels(*key).set(0)
        for key, length in lengths.items():
            self.admission_queue_length.labels(*key).set(length)
        self._queue_length_seen = set(lengths)
        stock: dict[str, int] = {}
        flows = 0
        for pool in pools:
            flows += pool.queue.active_flows
            for model, count in pool.stock_by_model.items():
                stock[model] = stock.get(model, 0) + count
            name = pool.key.replace("\n", ",")
            self.admission_lower.labels(name).set(pool.band.lower)
            self.admission_upper.labels(name).set(pool.band.upper)
            self.admission_watermark.labels(name).set(pool.band.watermark)
        for model in self._stock_seen - stock.keys():
            self.admission_stock.labels(model).set(0)
        for model, count in stock.items():
            self.admission_stock.labels(model).set(count)
        self._stock_seen = set(stock)
        self.admission_active_flows.set(flows)
        if dequeue_attempts > 0:
            self.admission_dequeue_attempts.inc(dequeue_attempts)
        if dequeue_successes > 0:
            self.admission_dequeue_successes.inc(dequeue_successes)

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
