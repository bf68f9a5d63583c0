"""Batch lines in this serving process.

``BatchMetrics`` is part of ``GatewayMetrics``: the batch lane's gauges (lines
waiting behind interactive requests, lines running) and the lines finished by
outcome. The wait of every band, batch included, is an admission metric
(``nexus_admission_band_wait_seconds``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class BatchMetrics:
    """The batch lane's metrics and the per-band admission waits."""

    def _add_batch_metrics(self, registry: CollectorRegistry) -> None:
        self.batch_lines_waiting = Gauge(
            "nexus_batch_lines_waiting",
            "Batch lines waiting in admission's batch lane, behind every "
            "interactive request.",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.batch_lines_running = Gauge(
            "nexus_batch_lines_running",
            "Batch lines let through admission and not finished.",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.batch_lines = Counter(
            "nexus_batch_lines",
            "Batch lines answered, by outcome (succeeded: a 2xx, failed: any "
            "other answer, yielding refusals included).",
            ("outcome",),
            registry=registry,
        )

    def set_batch_lanes(self, waiting: int, running: int) -> None:
        """Set the batch lane's gauges (off the request path)."""
        self.batch_lines_waiting.set(waiting)
        self.batch_lines_running.set(running)

    def batch_line_done(self, succeeded: bool) -> None:
        self.batch_lines.labels("succeeded" if succeeded else "failed").inc()
