"""The metrics of one serving process: every series, the counting, the rendering.

``GatewayMetrics`` owns a registry of its own with the request, token, backend,
limit, spend and usage-buffer metrics (plus the admission and fleet families
from ``AdmissionMetrics`` and ``FleetMetrics``). The request path counts through
cached children only; gauges are set off it. ``render()`` gives this process's
Prometheus text, or in multiprocess mode the sum over every sibling's files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import multiprocess as prometheus_multiprocess

from gateway.metrics.admission import AdmissionMetrics
from gateway.metrics.batches import BatchMetrics
from gateway.metrics.buckets import LATENCY_BUCKETS, TTFB_BUCKETS
from gateway.metrics.fleet import FleetMetrics
from gateway.metrics.prefix import PrefixMetrics
from gateway.metrics.restarts import restarts_collector
from gateway.metrics.traffic import TrafficMetrics

UNKNOWN = "unknown"


def is_multiprocess() -> bool:
    """Whether this process shares its metrics with siblings through files."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class GatewayMetrics(
    AdmissionMetrics, BatchMetrics, FleetMetrics, PrefixMetrics, TrafficMetrics
):
    """The metrics of one serving process (a registry of its own)."""

    def __init__(self, *, per_key: bool = False) -> None:
        # Key prefixes are labels only when asked (NEXUS_METRICS_PER_KEY):
        # whoever reads /metrics otherwise learns which keys exist and spend.
        self.per_key = per_key
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
        self._add_batch_metrics(registry)
        self._add_fleet_metrics(registry)
        self._add_prefix_metrics(registry)
        self._add_traffic_metrics(registry)
        # The launcher's restart counts (read from its file at each scrape).
        self._restarts = restarts_collector()
        if self._restarts is not None and not is_multiprocess():
            registry.register(self._restarts)
        self.limited = Counter(
            "nexus_requests_limited",
            "Requests refused by a key's limits, by reason: requests, tokens, "
            "concurrency, budget, unavailable (limiter down, fail closed), "
            "model_not_allowed, expired, streams (a key's open streams in one "
            "serving process).",
            ("reason",),
            registry=registry,
        )
        self.budget_cutoffs = Counter(
            "nexus_budget_cutoffs",
            "Streams cut off mid-answer because the key's budget ran out.",
            registry=registry,
        )
        self.cache_lookups = Counter(
            "nexus_cache_lookups",
            "Requests the response cache looked at, by result: hit, miss, "
            "bypass (not cacheable, or the client said no-cache/no-store).",
            ("result",),
            registry=registry,
        )
        self.cache_stores = Counter(
            "nexus_cache_stores",
            "Answers offered to the response cache, by result: stored, "
            "too_large, failed.",
            ("result",),
            registry=registry,
        )
        self.cache_errors = Counter(
            "nexus_cache_errors",
            "Response cache operations that failed (Redis unreachable or slow); "
            "the request was served uncached.",
            registry=registry,
        )
        self.limiter_errors = Counter(
            "nexus_limiter_errors",
            "Limiter calls that failed because Redis could not be reached.",
            registry=registry,
        )
        self.key_spend = Counter(
            "nexus_key_spend_usd",
            "Spend (USD at the model prices) by client key prefix with "
            'NEXUS_METRICS_PER_KEY, else in one series (key="all").',
            ("key",),
            registry=registry,
        )
        self._limited_children: dict[str, Any] = {}
        self._spend_children: dict[str, Any] = {}
        # Per backend, the (up, in flight) values last set (set_backends).
        self._backends_shown: dict[str, tuple[int, int]] = {}
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

    def observe_tokens(
        self, model: str, backend: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """Count the tokens a backend spent on one request."""
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
        if not self.per_key:
            key = "all"
        child = self._spend_children.get(key)
        if child is None:
            child = self._spend_children[key] = self.key_spend.labels(
                key or "anonymous"
            )
        child.inc(nanos / 1e9)

    def set_backends(
        self, in_flight: dict[str, int], up: Iterable[tuple[str, bool]]
    ) -> None:
        """Set the per-backend gauges (periodically, off the request path).

        Only the values that changed are set: a fleet of 1,000 relay workers
        made this second's work a noticeable share of an idle process's CPU.
        """
        shown = self._backends_shown
        for name, is_up in up:
            value = (1 if is_up else 0, in_flight.get(name, 0))
            if shown.get(name) != value:
                shown[name] = value
                self.backend_up.labels(name).set(value[0])
                self.in_flight.labels(name).set(value[1])

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
        if self._restarts is not None:
            merged.register(self._restarts)
        return generate_latest(merged)
