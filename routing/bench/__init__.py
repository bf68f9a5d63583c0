"""``make bench``: how much latency, throughput and memory the proxy costs.

One mock backend is loaded directly and then through Nexus (one serving
process, under Daphne and then uvicorn, on the same ASGI application), with wrk
for throughput and small raw-socket clients for latency and streaming
time-to-first-byte; ``report`` compares the two and checks issue 6's goals.
"""

from __future__ import annotations

from routing.bench.clients import BenchError
from routing.bench.database import child_environment, ensure_database
from routing.bench.report import format_report, write_json
from routing.bench.runner import BenchOptions, run_benchmark

__all__ = [
    "BenchError",
    "BenchOptions",
    "child_environment",
    "ensure_database",
    "format_report",
    "run_benchmark",
    "write_json",
]
