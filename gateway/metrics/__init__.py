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

The package: ``registry`` (``GatewayMetrics``, the process's metrics and their
rendering), ``admission`` and ``fleet`` (the metric families of those parts),
``buckets`` (histogram buckets) and ``endpoint`` (``MetricsEndpoint``).
"""

from __future__ import annotations

from gateway.metrics.buckets import LATENCY_BUCKETS, TTFB_BUCKETS
from gateway.metrics.endpoint import MetricsEndpoint, Network, parse_networks
from gateway.metrics.registry import UNKNOWN, GatewayMetrics, is_multiprocess

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
