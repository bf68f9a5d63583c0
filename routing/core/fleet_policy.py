"""The fleet strategy's settings: its points table and its queue knobs.

One table (``FLEET_SETTINGS``) names every setting once, with its default (the
fleet routing seed's), its range and a short label. The policy row's fields,
the configuration file's ``[routing.fleet]`` keys, the REST API and the
``NEXUS_ROUTING_FLEET_*`` environment overrides all read their names and
ranges from it, so the four cannot disagree.

``hold_seconds`` is special: None means "the preset", 30 s under the fleet
strategy and 0 (answer at once) under every other strategy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import NamedTuple

# The hold a fleet policy gets when none is set (the seed's holding queue).
FLEET_PRESET_HOLD_SECONDS = 30.0
ENV_PREFIX = "NEXUS_ROUTING_FLEET_"


class FleetSetting(NamedTuple):
    """One setting: its name, type, default, inclusive range and label."""

    name: str
    kind: type[int | float]
    default: float | None
    low: float
    high: float
    label: str

    @property
    def env_name(self) -> str:
        """The environment variable that overrides it."""
        return ENV_PREFIX + self.name.removeprefix("fleet_").upper()

    def problem(self, value: object) -> str | None:
        """Why `value` is not valid for this setting (None when it is)."""
        if value is None and self.default is None:
            return None
        whole = self.kind is int
        ok = (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (not whole or float(value).is_integer())
            and self.low <= value <= self.high
        )
        if ok:
            return None
        what = "a whole number" if whole else "a number"
        return f"must be {what} from {self.low:g} to {self.high:g}, got {value!r}"


FLEET_SETTINGS: tuple[FleetSetting, ...] = (
    # Signal 1: thermal state.
    FleetSetting("hot_points", int, 50, 0, 1000, "points for a model loaded now"),
    FleetSetting("warm_points", int, 30, 0, 1000, "points for a model loaded recently"),
    FleetSetting("on_disk_points", int, 10, 0, 1000, "points for a model on disk"),
    FleetSetting(
        "warm_window_seconds",
        float,
        1800.0,
        0,
        86400,
        "seconds after unloading a model still counts as warm",
    ),
    FleetSetting(
        "served_hot_seconds",
        float,
        300.0,
        0,
        86400,
        "seconds a model counts as hot after it answered a request",
    ),
    # Signal 2: memory fit, by fit ratio (free memory / model size).
    FleetSetting("fit_over_2_points", int, 20, 0, 1000, "points for fit ratio > 2"),
    FleetSetting("fit_over_1_5_points", int, 15, 0, 1000, "points for fit ratio 1.5-2"),
    FleetSetting(
        "fit_over_1_2_points", int, 8, 0, 1000, "points for fit ratio 1.2-1.5"
    ),
    FleetSetting("fit_over_1_points", int, 3, 0, 1000, "points for fit ratio 1-1.2"),
    # Signals 3 and 4: queue depth and estimated wait (penalties).
    FleetSetting(
        "queue_points_per_request",
        float,
        6.0,
        0,
        1000,
        "points taken per request in flight or waiting",
    ),
    FleetSetting(
        "queue_penalty_max", float, 30.0, 0, 1000, "largest queue depth penalty"
    ),
    FleetSetting(
        "wait_seconds_per_point",
        float,
        10.0,
        0.001,
        3600,
        "seconds of estimated wait that cost one point",
    ),
    FleetSetting(
        "wait_penalty_max", float, 25.0, 0, 1000, "largest estimated wait penalty"
    ),
    # Signals 5 to 7.
    FleetSetting(
        "affinity_max_points", int, 15, 0, 1000, "points for the best role affinity"
    ),
    FleetSetting(
        "trend_rising_points", int, 10, 0, 1000, "points for rising availability"
    ),
    FleetSetting(
        "trend_stable_points", int, 5, 0, 1000, "points for stable availability"
    ),
    FleetSetting(
        "trend_falling_points", int, 0, 0, 1000, "points for falling availability"
    ),
    FleetSetting(
        "context_fit_max_points", int, 10, 0, 1000, "points for the best context fit"
    ),
    # Queues, pre-warm, rebalance and holding (read by the proxy's fleet queues).
    FleetSetting(
        "pre_warm_threshold",
        int,
        3,
        1,
        1000,
        "queue depth of the winner above which the runner-up is pre-warmed",
    ),
    FleetSetting(
        "rebalance_threshold",
        int,
        4,
        1,
        1000,
        "queue depth above which waiting requests may move",
    ),
    FleetSetting(
        "rebalance_interval_seconds",
        float,
        5.0,
        0.1,
        3600,
        "seconds between rebalance rounds",
    ),
    FleetSetting(
        "rebalance_max_moves", int, 3, 0, 1000, "requests moved per rebalance round"
    ),
    FleetSetting(
        "hold_seconds",
        float,
        None,
        0,
        3600,
        "seconds a request waits when no backend can take it (empty: 30 under "
        "the fleet strategy, 0 otherwise)",
    ),
    FleetSetting(
        "fleet_queue_length",
        int,
        100,
        1,
        100_000,
        "requests that may wait per backend and model",
    ),
    FleetSetting(
        "fleet_queue_timeout_seconds",
        float,
        60.0,
        0.1,
        3600,
        "seconds a request may wait in a backend's queue",
    ),
)
FLEET_SETTING_NAMES = tuple(setting.name for setting in FLEET_SETTINGS)
SETTINGS_BY_NAME: Mapping[str, FleetSetting] = {s.name: s for s in FLEET_SETTINGS}


@dataclass(frozen=True, slots=True)
class FleetPolicy:
    """The fleet strategy's points and queue settings (see FLEET_SETTINGS).

    Raises ValueError when a value is outside its range.
    """

    hot_points: int = 50
    warm_points: int = 30
    on_disk_points: int = 10
    warm_window_seconds: float = 1800.0
    served_hot_seconds: float = 300.0
    fit_over_2_points: int = 20
    fit_over_1_5_points: int = 15
    fit_over_1_2_points: int = 8
    fit_over_1_points: int = 3
    queue_points_per_request: float = 6.0
    queue_penalty_max: float = 30.0
    wait_seconds_per_point: float = 10.0
    wait_penalty_max: float = 25.0
    affinity_max_points: int = 15
    trend_rising_points: int = 10
    trend_stable_points: int = 5
    trend_falling_points: int = 0
    context_fit_max_points: int = 10
    pre_warm_threshold: int = 3
    rebalance_threshold: int = 4
    rebalance_interval_seconds: float = 5.0
    rebalance_max_moves: int = 3
    hold_seconds: float | None = None
    fleet_queue_length: int = 100
    fleet_queue_timeout_seconds: float = 60.0

    def __post_init__(self) -> None:
        problems = check_fleet_values(
            {item.name: getattr(self, item.name) for item in fields(self)}
        )
        if problems:
            raise ValueError(
                "; ".join(f"{name}: {message}" for name, message in problems.items())
            )

    def hold_for(self, *, is_fleet: bool) -> float:
        """The seconds to hold a request: the setting, or the strategy's preset."""
        if self.hold_seconds is not None:
            return self.hold_seconds
        return FLEET_PRESET_HOLD_SECONDS if is_fleet else 0.0


def check_fleet_values(values: Mapping[str, object]) -> dict[str, str]:
    """Every invalid value among `values`, by setting name (unknown names too)."""
    found: dict[str, str] = {}
    for name, value in values.items():
        setting = SETTINGS_BY_NAME.get(name)
        if setting is None:
            found[name] = "is not a fleet setting"
            continue
        problem = setting.problem(value)
        if problem is not None:
            found[name] = problem
    return found
