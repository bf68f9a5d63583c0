"""The histogram buckets of the gateway's metrics, in seconds.

``LATENCY_BUCKETS`` spans a fast answer to a five-minute generation (request
durations and the time requests wait in a queue); ``TTFB_BUCKETS`` starts at a
millisecond, where the first byte of a short answer lands.
"""

from __future__ import annotations

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
TTFB_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0,
)  # fmt: skip
