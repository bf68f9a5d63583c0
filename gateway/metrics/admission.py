"""The admission control metrics: the fair queue, the stock and each pool's band.

``AdmissionMetrics`` is part of ``GatewayMetrics``: it adds these metrics to
the process's registry, with the calls ``gateway.admission`` makes to count
requests let straight through, refused or decided after waiting, and to set
the queue, stock and band gauges from the controller, off the request path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.metrics.buckets import LATENCY_BUCKETS


class AdmissionMetrics:
    """The admission queue's and controller's metrics, in GatewayMetrics."""

    def _add_admission_metrics(self, registry: CollectorRegistry) -> None:
        self.admission_queue_length = Gauge(
            "nexus_admission_queue_length",
            "Requests waiting in the admission queue, by requested model, the "
            "model that serves them (target_model: an alias's target, a "
            "fallback) and flow.",
            ("model", "target_model", "flow"),
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.admission_queue_latency = Histogram(
            "nexus_admission_queue_latency_seconds",
            "Time requests spent in the admission queue; success is false for "
            "those that never reached a backend (TTL, deadline, preempted, gone).",
            ("model", "target_model", "success"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.admission_band_wait = Histogram(
            "nexus_admission_band_wait_seconds",
            "Time requests that queued waited in admission, by band (their "
            "criticality, or batch for batch lines).",
            ("band",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.admission_stock = Gauge(
            "nexus_admission_stock_level",
            "Requests let through admission control and not yet finished.",
            ("model", "target_model"),
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.admission_stock_tokens = Gauge(
            "nexus_admission_stock_tokens",
            "Estimated tokens (prompt and expected output) of the requests let "
            "through and not yet finished, by the model that serves them.",
            ("target_model",),
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.admission_bypassed = Counter(
            "nexus_admission_bypass",
            "Requests that went straight through (nothing waiting, stock low).",
            ("model", "target_model"),
            registry=registry,
        )
        self.admission_expired = Counter(
            "nexus_admission_requests_expired",
            "Requests that waited past the queue TTL (503 queue_ttl_expired) or "
            "their own deadline (504 deadline_exceeded), by reason.",
            ("model", "target_model", "reason"),
            registry=registry,
        )
        self.admission_cancelled = Counter(
            "nexus_admission_requests_cancelled",
            "Requests whose client left while they waited (499).",
            ("model", "target_model"),
            registry=registry,
        )
        self.admission_push_errors = Counter(
            "nexus_admission_queue_push_errors",
            "Requests the queue refused, by error type (queue_full: "
            "ErrTooManyFlows, flow_queue_full: ErrInsufficientFlowCapacity).",
            ("model", "target_model", "error_type"),
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
            "The band's lower bound of each model's pool (whole gateway).",
            ("pool",),
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.admission_upper = Gauge(
            "nexus_admission_upper_bound",
            "The band's upper bound of each model's pool (whole gateway).",
            ("pool",),
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.admission_watermark = Gauge(
            "nexus_admission_watermark",
            "The watermark of each model's pool (whole gateway).",
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
        self._bypass_children: dict[tuple[str, str], Any] = {}
        self._queue_length_seen: set[tuple[str, ...]] = set()
        self._stock_seen: set[tuple[str, ...]] = set()
        self._stock_tokens_seen: set[tuple[str, ...]] = set()

    def admission_bypass(self, model: str, target: str) -> None:
        """Count a request that went straight through (the hot path: cached)."""
        key = (model, target)
        child = self._bypass_children.get(key)
        if child is None:
            child = self._bypass_children[key] = self.admission_bypassed.labels(*key)
        child.inc()

    def admission_decided(self, ticket: Any) -> None:
        """Count a waiting request's outcome (a routing.admission Ticket)."""
        outcome = ticket.outcome.value if ticket.outcome is not None else ""
        model, target = ticket.model, ticket.pool_key
        waited = (ticket.decided_at or ticket.arrived) - ticket.arrived
        success = "true" if outcome == "dispatched" else "false"
        self.admission_queue_latency.labels(model, target, success).observe(
            max(0.0, waited)
        )
        band = "batch" if ticket.batch else ticket.criticality.label
        self.admission_band_wait.labels(band).observe(max(0.0, waited))
        if outcome in ("expired", "deadline"):
            self.admission_expired.labels(model, target, outcome).inc()
        elif outcome == "cancelled":
            self.admission_cancelled.labels(model, target).inc()
        elif outcome == "preempted":
            self.admission_preemptions.labels(ticket.criticality.label).inc()

    def admission_refused(self, model: str, target: str, error_type: str) -> None:
        self.admission_push_errors.labels(model, target, error_type).inc()

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
        lengths: dict[tuple[str, str, str], int] = {}
        for ticket in waiting:
            key = (ticket.model, ticket.pool_key, ticket.flow or "-")
            lengths[key] = lengths.get(key, 0) + 1
        self._queue_length_seen = _set_series(
            self.admission_queue_length, lengths, self._queue_length_seen
        )
        stock: dict[tuple[str, str], int] = {}
        stock_tokens: dict[tuple[str], int] = {}
        flows = 0
        for pool in pools:
            flows += pool.queue.active_flows
            name = pool.key
            for model, count in pool.stock_by_model.items():
                stock[model, name] = stock.get((model, name), 0) + count
            if pool.stock_tokens:
                stock_tokens[name,] = round(pool.stock_tokens)
            self.admission_lower.labels(name).set(pool.band.lower)
            self.admission_upper.labels(name).set(pool.band.upper)
            self.admission_watermark.labels(name).set(pool.band.watermark)
        self._stock_seen = _set_series(self.admission_stock, stock, self._stock_seen)
        self._stock_tokens_seen = _set_series(
            self.admission_stock_tokens, stock_tokens, self._stock_tokens_seen
        )
        self.admission_active_flows.set(flows)
        if dequeue_attempts > 0:
            self.admission_dequeue_attempts.inc(dequeue_attempts)
        if dequeue_successes > 0:
            self.admission_dequeue_successes.inc(dequeue_successes)


def _set_series(
    gauge: Gauge, values: Mapping[Any, int], seen: set[tuple[str, ...]]
) -> set[tuple[str, ...]]:
    """Set one series of `gauge` per key (its label values) of `values`, and
    those of `seen` that are gone to 0; return the keys set now."""
    for key in seen - values.keys():
        gauge.labels(*key).set(0)
    for key, value in values.items():
        gauge.labels(*key).set(value)
    return set(values)
