"""The router core: pure Python over immutable data, no Django.

``routing/snapshot.py`` builds a RouterSnapshot from the database; the proxy
reads RequestRequirements from each body and asks a process-wide Router to
select() a backend, counting the request in a process-wide LiveStats.
"""

from __future__ import annotations

from routing.core.decision import (
    Attempt,
    Candidate,
    Decision,
    Exclusion,
    Outcome,
    Role,
    Via,
)
from routing.core.errors import (
    CapabilityMismatch,
    CircularAlias,
    FallbackChainExhausted,
    InvalidModel,
    InvalidRequest,
    ModelNotFound,
    NoHealthyBackend,
    OpenAIErrorBody,
    RoutingError,
)
from routing.core.fleet import FleetScore, score_fleet
from routing.core.fleet_policy import (
    FLEET_SETTING_NAMES,
    FLEET_SETTINGS,
    FleetPolicy,
    FleetSetting,
    check_fleet_values,
)
from routing.core.policy import (
    MAX_RETRIES_ENV,
    STRATEGY_ENV,
    Policy,
    apply_overrides,
    make_policy,
    parse_strategy,
)
from routing.core.requirements import RequestRequirements
from routing.core.router import Route, Router
from routing.core.scoring import ScoreComponents, ScoringWeights, score_backend
from routing.core.shapes import DecisionDict
from routing.core.stats import LiveStats
from routing.core.types import BackendSpec, ModelSpec, RouterSnapshot, Target
from routing.core.vocabulary import Health, Reason, Strategy, Thermal, Trend

__all__ = [
    "FLEET_SETTINGS",
    "FLEET_SETTING_NAMES",
    "MAX_RETRIES_ENV",
    "STRATEGY_ENV",
    "Attempt",
    "BackendSpec",
    "Candidate",
    "CapabilityMismatch",
    "CircularAlias",
    "Decision",
    "DecisionDict",
    "Exclusion",
    "FallbackChainExhausted",
    "FleetPolicy",
    "FleetScore",
    "FleetSetting",
    "Health",
    "InvalidModel",
    "InvalidRequest",
    "LiveStats",
    "ModelNotFound",
    "ModelSpec",
    "NoHealthyBackend",
    "OpenAIErrorBody",
    "Outcome",
    "Policy",
    "Reason",
    "RequestRequirements",
    "Role",
    "Route",
    "Router",
    "RouterSnapshot",
    "RoutingError",
    "ScoreComponents",
    "ScoringWeights",
    "Strategy",
    "Target",
    "Thermal",
    "Trend",
    "Via",
    "apply_overrides",
    "check_fleet_values",
    "make_policy",
    "parse_strategy",
    "score_backend",
    "score_fleet",
]
