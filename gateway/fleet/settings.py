"""The fleet scheduler's knobs, read from the routing policy of a snapshot.

The policy fields are the routing policy's (admin, TOML ``[routing.fleet]``,
API, ``NEXUS_ROUTING_FLEET_*``; routing/core/fleet_policy.py); the scheduler
reads them once per snapshot into this flat record.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.core.policy import Policy
from routing.core.vocabulary import Strategy

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
    def from_policy(cls, policy: Policy) -> FleetSettings:
        """Read the fleet fields of a routing policy."""
        return cls(
            enabled=policy.strategy is Strategy.FLEET,
            pre_warm_threshold=policy.pre_warm_threshold,
            rebalance_threshold=policy.rebalance_threshold,
            rebalance_interval_seconds=policy.rebalance_interval_seconds,
            rebalance_max_moves=policy.rebalance_max_moves,
            hold_seconds=policy.hold_seconds,
            queue_length=policy.fleet_queue_length,
            queue_timeout_seconds=policy.fleet_queue_timeout_seconds,
        )
