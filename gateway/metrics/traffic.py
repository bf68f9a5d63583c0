"""Hedging's and shadows' metrics (gateway/proxy/hedging.py, gateway/shadows.py).

``TrafficMetrics`` is part of ``GatewayMetrics``. Series are labelled by the
model, which the configuration bounds (only hedged or shadowed models).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

HEDGE_WINNERS = ("first", "hedge")
SHADOW_OUTCOMES = ("compared", "failed", "timeout", "shed")


class TrafficMetrics:
    """Hedging's and shadows' metrics, in GatewayMetrics."""

    def _add_traffic_metrics(self, registry: CollectorRegistry) -> None:
        self.hedges = Counter(
            "nexus_hedges",
            "Extra attempts started because the first had produced no byte in time.",
            ("model",),
            registry=registry,
        )
        self.hedge_wins = Counter(
            "nexus_hedge_wins",
            "Hedged requests by the attempt that produced the first byte: "
            "first (the original) or hedge (an extra one).",
            ("model", "winner"),
            registry=registry,
        )
        self.hedge_waste = Counter(
            "nexus_hedge_waste_tokens",
            "Prompt tokens (estimated) sent to attempts that lost a hedge race "
            "and were cancelled: the cost of hedging.",
            ("model",),
            registry=registry,
        )
        self.shadow_requests = Counter(
            "nexus_shadow_requests",
            "Requests mirrored to a shadow model, by outcome: compared, failed, "
            "timeout, shed (admission turned it away, or too many in flight).",
            ("model", "outcome"),
            registry=registry,
        )
