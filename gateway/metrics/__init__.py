"""Prometheus metrics of the gateway, and the /metrics endpoint that serves them.

Importers use the names below: ``GatewayMetrics`` (one serving process's
metrics) and ``MetricsEndpoint`` with ``parse_networks`` (who may read them).
"""

from __future__ import annotations

from gateway.metrics.registry import (
    LATENCY_BUCKETS,
    TTFB_BUCKETS,
    UNKNOWN,
    GatewayMetrics,
    MetricsEndpoint,
    Network,
    is_multiprocess,
    parse_networks,
)

__all__ = [
    "LATENCY_BUCKETS",
    "TTFB_BUCKETS",
    "UNKNOWN",
    "GatewayMetrics",
    "MetricsEndpoint",
    "Network",
    "is_multiprocess",
    "parse_networks",
]
