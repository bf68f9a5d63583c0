"""The fleet scheduler's knobs, read from the routing policy of a snapshot.

The policy fields are the routing policy's (admin, TOML ``[routing.fleet]``,
API, ``NEXUS_ROUTING_*``); they are read with ``getattr`` and these defaults so
that a policy without them (an older snapshot, a test's bare Policy) schedules
as the seed's defaults say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FLEET_STRATEGY = "fleet"
# Requests held at once per process when no backend can serve their model;
# more are answered at once, as with hold_seconds 0.
MAX_HELD = 1000
# How often a held request re-routes even when no snapshot was installed
# (an open circuit closing, live stats changing): the seed's two seconds.
HOLD_RECHECK_SECONDS = 2.0
# A model warmed on a backend is not warmed there again for this long
# (Ollama's default keep_alive): the snapshot learns it is hot meanwhile.
PREWARM_MEMORY_SECONDS = 300.0


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """What the queues, pre-warm, rebalance and holding queue run with."""

    enabled: bool = False  # the policy's strategy is "fleet"
    pre_warm_threshold: int = 3
    rebalance_threshold: int = 4
    rebalance_interval_seconds: float = 5.0
    rebalance_max_moves: int = 3
    hold_seconds: float = 0.0
    queue_length: int = 100
    queue_timeout_seconds: float = 60.0

    @classmethod
    def from_policy(cls, policy: Any) -> FleetSettings:
        """Read the fleet fields of a routing policy (defaults where absent)."""
        default = cls()
        return cls(
            enabled=str(getattr(policy, "strategy", "")) == FLEET_STRATEGY,
            pre_warm_threshold=int(
                getattr(policy, "pre_warm_threshold", default.pre_warm_threshold)
            ),
            rebalance_threshold=int(
                getattr(policy, "rebalance_threshold", default.rebalance_threshold)
            ),
            rebalance_interval_seconds=max(
                0.1,
                float(
                    getattr(
                        policy,
                        "rebalance_interval_seconds",
                        default.rebalance_interval_seconds,
                    )
                ),
            ),
            rebalance_max_moves=int(
                getattr(policy, "rebalance_max_moves", default.rebalance_max_moves)
            ),
            hold_seconds=max(
                0.0, float(getattr(policy, "hold_seconds", default.hold_seconds))
            ),
            queue_length=int(
                getattr(policy, "fleet_queue_length", default.queue_length)
            ),
            queue_timeout_seconds=float(
                getattr(
                    policy,
                    "fleet_queue_timeout_seconds",
                    default.queue_timeout_seconds,
                )
            ),
        )
