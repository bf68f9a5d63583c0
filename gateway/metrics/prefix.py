"""Prefix-aware routing's metrics: matches, matched length, guard, sessions.

``PrefixMetrics`` is part of ``GatewayMetrics``. Its series are labelled by
the signal that decided (a fixed set) only, so they stay few whatever the
traffic; ``count_choice`` touches cached children.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

# Matched blocks: powers of two up to MAX_KEYED_BLOCKS (routing.core.prefix).
MATCHED_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SIGNALS = ("prefix", "session", "load-guard", "strategy")


class PrefixMetrics:
    """Prefix routing's metrics, in GatewayMetrics."""

    def _add_prefix_metrics(self, registry: CollectorRegistry) -> None:
        """Prefix routing's (gateway/prefix.py, routing/core/prefix.py)."""
        self.prefix_decisions = Counter(
            "nexus_prefix_decisions",
            "Decisions with prefix routing on, by the signal that decided: "
            "prefix (a backend holding the prompt's prefix), session, "
            "load-guard (the prefix's or session's backend was too busy), "
            "strategy (nothing matched).",
            ("signal",),
            registry=registry,
        )
        self.prefix_matched_blocks = Histogram(
            "nexus_prefix_matched_blocks",
            "Prompt blocks the chosen backend was thought to hold already.",
            buckets=MATCHED_BLOCK_BUCKETS,
            registry=registry,
        )
        self.prefix_guard_overrides = Counter(
            "nexus_prefix_guard_overrides",
            "Requests the load guard sent away from the backend holding their "
            "prefix or session.",
            registry=registry,
        )
        self.prefix_session_hits = Counter(
            "nexus_prefix_session_hits",
            "Requests that went to their session's backend.",
            registry=registry,
        )
        self._prefix_children: dict[str, Any] = {
            signal: self.prefix_decisions.labels(signal) for signal in SIGNALS
        }

    def count_prefix_choice(self, signal: str, matched: int, guarded: bool) -> None:
        """Count one decision prefix routing took part in."""
        self._prefix_children[signal].inc()
        self.prefix_matched_blocks.observe(matched)
        if guarded:
            self.prefix_guard_overrides.inc()
        if signal == "session":
            self.prefix_session_hits.inc()
