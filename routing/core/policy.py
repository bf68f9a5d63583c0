"""The routing policy: strategy, scoring weights, retries, and env overrides."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from routing.core.cache_policy import CachePolicy
from routing.core.context_shift_policy import ContextShiftPolicy
from routing.core.ensemble_policy import EnsemblePolicy
from routing.core.fleet_policy import FLEET_SETTINGS, FleetPolicy
from routing.core.prefix_policy import PrefixPolicy
from routing.core.scoring import ScoringWeights
from routing.core.vocabulary import Strategy

logger = logging.getLogger(__name__)

STRATEGY_ENV = "NEXUS_ROUTING_STRATEGY"
MAX_RETRIES_ENV = "NEXUS_ROUTING_MAX_RETRIES"
MAX_RETRIES_LIMIT = 10

# Values already warned about, so that a bad setting read on every snapshot
# rebuild is logged once per process rather than once per rebuild.
_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class Policy:
    """The global routing policy the router applies."""

    strategy: Strategy = Strategy.SMART
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    max_retries: int = 2
    fleet: FleetPolicy = field(default_factory=FleetPolicy)
    context_shift: ContextShiftPolicy = field(default_factory=ContextShiftPolicy)
    ensemble: EnsemblePolicy = field(default_factory=EnsemblePolicy)
    prefix: PrefixPolicy = field(default_factory=PrefixPolicy)
    cache: CachePolicy = field(default_factory=CachePolicy)

    def __post_init__(self) -> None:
        if not 0 <= self.max_retries <= MAX_RETRIES_LIMIT:
            raise ValueError(
                f"max_retries must be within 0..{MAX_RETRIES_LIMIT}, "
                f"got {self.max_retries}"
            )

    # The fleet queues' settings, under the names the proxy reads them by
    # (``state.routes.policy.<name>``).

    @property
    def pre_warm_threshold(self) -> int:
        """Winner's queue depth above which the runner-up is pre-warmed."""
        return self.fleet.pre_warm_threshold

    @property
    def rebalance_threshold(self) -> int:
        """Queue depth above which waiting requests may move elsewhere."""
        return self.fleet.rebalance_threshold

    @property
    def rebalance_interval_seconds(self) -> float:
        """Seconds between rebalance rounds."""
        return self.fleet.rebalance_interval_seconds

    @property
    def rebalance_max_moves(self) -> int:
        """Waiting requests moved per rebalance round, at most."""
        return self.fleet.rebalance_max_moves

    @property
    def hold_seconds(self) -> float:
        """Seconds to hold a request nothing can take (30 under fleet by default)."""
        return self.fleet.hold_for(is_fleet=self.strategy is Strategy.FLEET)

    @property
    def fleet_queue_length(self) -> int:
        """Requests that may wait per backend and model."""
        return self.fleet.fleet_queue_length

    @property
    def waits_at_backends(self) -> int:
        """Requests that may wait per backend beyond its max_concurrency.

        Under the fleet strategy a backend at its max_concurrency stays a
        candidate and requests wait in its lines (``fleet_queue_length``);
        under the others it is skipped, so none wait there (0). The router's
        capacity filter and admission control's band both read this.
        """
        if self.strategy is Strategy.FLEET:
            return self.fleet.fleet_queue_length
        return 0

    @property
    def fleet_queue_timeout_seconds(self) -> float:
        """Seconds a request may wait in a backend and model's queue."""
        return self.fleet.fleet_queue_timeout_seconds


def parse_strategy(value: str, *, source: str = "the routing policy") -> Strategy:
    """Return the strategy named `value`, or smart (warning once) if unknown."""
    try:
        return Strategy(value.strip().lower())
    except ValueError:
        _warn_once(
            f"strategy:{source}:{value}",
            "Unknown routing strategy %r in %s; using 'smart'. Choose one of: %s",
            value,
            source,
            ", ".join(s.value for s in Strategy),
        )
        return Strategy.SMART


def make_policy(
    *,
    strategy: str = Strategy.SMART,
    weight_priority: int = 50,
    weight_load: int = 30,
    weight_latency: int = 20,
    max_retries: int = 2,
    fleet: FleetPolicy | None = None,
) -> Policy:
    """Build a Policy from the stored fields of a RoutingPolicy row.

    An unknown strategy becomes smart (with a warning); weights that do not sum
    to 100 raise ValueError, since the database constraint forbids them.
    """
    return Policy(
        strategy=parse_strategy(strategy),
        weights=ScoringWeights(
            priority=weight_priority, load=weight_load, latency=weight_latency
        ),
        max_retries=min(max(max_retries, 0), MAX_RETRIES_LIMIT),
        fleet=fleet or FleetPolicy(),
    )


def apply_overrides(policy: Policy, environ: Mapping[str, str]) -> Policy:
    """Return `policy` with NEXUS_ROUTING_STRATEGY / _MAX_RETRIES / _FLEET_* applied.

    Empty variables are ignored. An unknown strategy means smart (the spec's
    default), warned about once. A max_retries that is not a whole number within
    0..10 is ignored, with a warning once, and the stored value is kept.
    """
    strategy = policy.strategy
    max_retries = policy.max_retries
    strategy_value = environ.get(STRATEGY_ENV, "").strip()
    if strategy_value:
        strategy = parse_strategy(strategy_value, source=STRATEGY_ENV)
    retries_value = environ.get(MAX_RETRIES_ENV, "").strip()
    if retries_value:
        try:
            parsed = int(retries_value)
        except ValueError:
            parsed = -1
        if 0 <= parsed <= MAX_RETRIES_LIMIT:
            max_retries = parsed
        else:
            _warn_once(
                f"retries:{retries_value}",
                "Ignoring %s=%r: use a whole number from 0 to %d; keeping %d",
                MAX_RETRIES_ENV,
                retries_value,
                MAX_RETRIES_LIMIT,
                policy.max_retries,
            )
    fleet = policy.fleet
    fleet_values = _fleet_overrides(environ)
    if fleet_values:
        fleet = replace(fleet, **fleet_values)  # type: ignore[arg-type]
    return replace(policy, strategy=strategy, max_retries=max_retries, fleet=fleet)


def _fleet_overrides(environ: Mapping[str, str]) -> dict[str, float]:
    """The NEXUS_ROUTING_FLEET_* values that are set and valid (others warned)."""
    values: dict[str, float] = {}
    for setting in FLEET_SETTINGS:
        raw = environ.get(setting.env_name, "").strip()
        if not raw:
            continue
        try:
            value: float = setting.kind(raw)
        except ValueError:
            value = math.nan
        if setting.problem(value) is None:
            values[setting.name] = value
        else:
            _warn_once(
                f"fleet:{setting.env_name}:{raw}",
                "Ignoring %s=%r: %s",
                setting.env_name,
                raw,
                setting.problem(value),
            )
    return values


def _warn_once(key: str, message: str, *args: object) -> None:
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(message, *args)
