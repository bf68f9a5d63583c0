"""The smart strategy's score: priority, load and latency, each 0..100, weighted.

The formula is the spec's::

    priority_score = 100 - min(priority, 100)
    load_score     = 100 - min(pending_requests, 100)
    latency_score  = 100 - min(avg_latency_ms / 10, 100)
    score = (priority_score * w_priority + load_score * w_load
             + latency_score * w_latency) / 100

with the weights summing to 100, so the score stays within 0..100. It is kept
as a float instead of the spec's integer arithmetic: truncating to whole points
would make a backend with three requests in flight tie with one that has one,
and ties go to the first candidate, so light load would never spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class ScoringWeights:
    """How much priority, load and latency count, in percent (they sum to 100)."""

    priority: int = 50
    load: int = 30
    latency: int = 20

    def __post_init__(self) -> None:
        weights = (self.priority, self.load, self.latency)
        if any(w < 0 for w in weights) or sum(weights) != 100:
            raise ValueError(
                "Scoring weights must be non-negative and sum to 100, got "
                f"priority={self.priority}, load={self.load}, "
                f"latency={self.latency}"
            )


class ScoreComponents(NamedTuple):
    """One backend's score and the three 0..100 parts it was computed from."""

    priority: float
    load: float
    latency: float
    total: float


def score_priority(priority: int) -> float:
    """Return 100 for priority 0 down to 0 for priority 100 or more."""
    return float(100 - min(max(priority, 0), 100))


def score_load(pending: int) -> float:
    """Return 100 for an idle backend down to 0 at 100 or more in flight."""
    return float(100 - min(max(pending, 0), 100))


def score_latency(latency_ms: float | None) -> float:
    """Return 100 for no latency data or 0 ms down to 0 at one second or more."""
    if latency_ms is None or math.isnan(latency_ms) or latency_ms <= 0:
        return 100.0
    return 100.0 - min(latency_ms / 10.0, 100.0)


def score_backend(
    priority: int,
    pending: int,
    latency_ms: float | None,
    weights: ScoringWeights,
) -> ScoreComponents:
    """Score one backend; the total is always within 0..100."""
    p = score_priority(priority)
    load = score_load(pending)
    lat = score_latency(latency_ms)
    total = (p * weights.priority + load * weights.load + lat * weights.latency) / 100
    return ScoreComponents(priority=p, load=load, latency=lat, total=total)
