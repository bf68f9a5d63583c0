"""The fleet scheduler's metrics: slot queues, warm-ups, moves and holds.

``FleetMetrics`` is part of ``GatewayMetrics``: it adds the metrics of
``gateway/fleet`` to the process's registry, and sets the waiting gauge of each
backend and model line (zeroing the lines that emptied).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.metrics.buckets import LATENCY_BUCKETS


class FleetMetrics:
    """The fleet scheduler's metrics, in GatewayMetrics."""

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
