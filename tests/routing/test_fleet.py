"""The fleet strategy (routing/core/fleet.py): seven signals, elimination, explain."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from routing.core import (
    BackendSpec,
    FleetPolicy,
    LiveStats,
    ModelSpec,
    Policy,
    Reason,
    RequestRequirements,
    Router,
    RouterSnapshot,
    Strategy,
    apply_overrides,
    make_policy,
)
from routing.core.decision import Decision
from routing.core.fleet import observe_decoding, observe_load
from routing.core.stats import MIN_LATENCY_SAMPLES
from routing.explain import render_decision

pytestmark = pytest.mark.mode_independent

NOW = 1_700_000_000.0  # wall clock (epoch seconds)
GB = 1.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def live(**fields: Any) -> LiveStats:
    return LiveStats(clock=Clock(100.0), wall_clock=Clock(NOW), **fields)


def model(**fields: Any) -> ModelSpec:
    return ModelSpec(name=fields.pop("name", "m"), **fields)


def backend(name: str, *models: ModelSpec, **fields: Any) -> BackendSpec:
    fields.setdefault("status", "healthy")
    return BackendSpec(
        name=name,
        base_url=f"http://{name}.lan:11434",
        kind="ollama",
        models=models or (model(),),
        **fields,
    )


def fleet_snapshot(
    *backends: BackendSpec, fleet: FleetPolicy | None = None
) -> RouterSnapshot:
    return RouterSnapshot.build(
        version=1,
        backends=backends,
        policy=make_policy(strategy="fleet", fleet=fleet),
    )


def explain(
    snap: RouterSnapshot, stats: LiveStats | None = None, tokens: int = 0
) -> Decision:
    requirements = RequestRequirements(model="m", estimated_tokens=tokens)
    return Router().explain(requirements, snap, stats or live())


def signals(decision: Decision) -> dict[str, dict[str, Any]]:
    """Each candidate's fleet signals, by backend name."""
    return {
        c["backend"]: c["fleet"]  # type: ignore[misc]
        for c in decision.as_dict()["candidates"]
    }


def only(
    snap_backend: BackendSpec, stats: LiveStats | None = None, tokens: int = 0
) -> dict[str, Any]:
    return signals(explain(fleet_snapshot(snap_backend), stats, tokens))[
        snap_backend.name
    ]


# Signal 1: thermal state ------------------------------------------------------


def test_thermal_points_follow_the_seeds_table() -> None:
    decision = explain(
        fleet_snapshot(
            backend("hot", model(loaded=True)),
            backend("warm", model(last_loaded_at=NOW - 20 * 60)),
            backend("disk", model(last_loaded_at=NOW - 40 * 60)),
            backend("absent", model(listed=False)),
        )
    )

    found = signals(decision)
    assert {name: s["thermal"] for name, s in found.items()} == {
        "hot": {"value": "hot", "points": 50},
        "warm": {"value": "warm", "points": 30},
        "disk": {"value": "on_disk", "points": 10},
        "absent": {"value": "absent", "points": 0},
    }


def test_a_model_past_its_keep_alive_is_warm_not_hot() -> None:
    expired = backend("b", model(loaded=True, expires_at=NOW - 60))
    still = backend("b", model(loaded=True, expires_at=NOW + 60))

    assert only(expired)["thermal"]["value"] == "warm"
    assert only(still)["thermal"]["value"] == "hot"


def test_a_backend_that_just_answered_for_the_model_makes_it_hot() -> None:
    stats = live()
    cold = backend("b", model())
    assert only(cold, stats)["thermal"]["value"] == "on_disk"

    stats.mark_hot("b", "m")

    assert only(cold, stats)["thermal"]["value"] == "hot"
    stats.wall_clock.now += 301  # type: ignore[attr-defined]  # served_hot_seconds
    assert only(cold, stats)["thermal"]["value"] == "warm"


def test_a_probe_newer_than_the_last_answer_that_lacks_the_model_wins() -> None:
    # Answered at NOW - 60; a probe at NOW - 30 saw it unloaded (evicted).
    stats = live()
    stats.wall_clock.now = NOW - 60  # type: ignore[attr-defined]
    stats.mark_hot("b", "m")
    stats.wall_clock.now = NOW  # type: ignore[attr-defined]
    evicted = backend("b", model(last_loaded_at=NOW - 30))
    reloaded = backend("b", model(last_loaded_at=NOW - 90))

    assert only(evicted, stats)["thermal"]["value"] == "warm"
    # The answer came after the probe that saw it unloaded: loaded again.
    assert only(reloaded, stats)["thermal"]["value"] == "hot"


def test_a_model_expected_unloaded_after_the_probe_is_not_hot() -> None:
    # The probe saw it loaded (first at NOW - 100); then this process sent
    # the backend a model that needed its memory (NOW - 10).
    stats = live()
    loaded = backend("b", model(loaded=True, last_loaded_at=NOW - 100))
    assert only(loaded, stats)["thermal"]["value"] == "hot"

    stats.wall_clock.now = NOW - 10  # type: ignore[attr-defined]
    stats.mark_evicted("b", "m")
    stats.wall_clock.now = NOW  # type: ignore[attr-defined]

    assert only(loaded, stats)["thermal"]["value"] == "warm"
    stats.mark_hot("b", "m")  # sent there again: loaded again
    assert only(loaded, stats)["thermal"]["value"] == "hot"


def test_an_expected_unload_no_probe_confirmed_lapses() -> None:
    # Past served_hot_seconds a probe would have seen the unload; it still
    # lists the model loaded, so the expectation was wrong.
    stats = live()
    stats.wall_clock.now = NOW - 301  # type: ignore[attr-defined]
    stats.mark_evicted("b", "m")
    stats.wall_clock.now = NOW  # type: ignore[attr-defined]

    loaded = backend("b", model(loaded=True, last_loaded_at=NOW - 400))

    assert only(loaded, stats)["thermal"]["value"] == "hot"


def test_hot_beats_a_better_priority_within_the_seeds_weights() -> None:
    snap = fleet_snapshot(
        backend("preferred-but-cold", model(), priority=0),
        backend("hot", model(loaded=True), priority=90),
    )

    decision = explain(snap)

    assert decision.chosen is not None
    assert decision.chosen.backend.name == "hot"
    # Under smart the same fleet goes by priority.
    smart = RouterSnapshot.build(backends=snap.backends, policy=Policy())
    chosen = Router().explain(RequestRequirements(model="m"), smart, live()).chosen
    assert chosen is not None and chosen.backend.name == "preferred-but-cold"


def test_a_short_queue_on_a_warm_node_beats_a_long_one_on_a_hot_node() -> None:
    stats = live()
    for _ in range(5):
        stats.add_waiting("hot", "m")
    snap = fleet_snapshot(
        backend("hot", model(loaded=True)),
        backend("warm", model(last_loaded_at=NOW - 60)),
    )

    decision = explain(snap, stats)

    # hot: 50 + 5 (stable) - 30 (queue) - wait; warm: 30 + 5.
    assert decision.chosen is not None and decision.chosen.backend.name == "warm"


# Signal 2: memory fit ---------------------------------------------------------


@pytest.mark.parametrize(
    ("free_gb", "points"),
    [(25.0, 20), (20.0, 15), (15.0, 15), (14.0, 8), (12.0, 8), (11.0, 3), (10.0, 3)],
)
def test_memory_fit_points_follow_the_seeds_table(free_gb: float, points: int) -> None:
    # A 10 GB model; another loaded model takes 30 GB of a (30 + free) GB ceiling.
    other = model(name="other", loaded=True, vram_gb=30.0)
    b = backend("b", model(size_gb=10.0), other, memory_ceiling_gb=30.0 + free_gb)

    fit = only(b)["memory_fit"]

    assert fit == {
        "value": round(free_gb / 10.0, 2),
        "points": points,
        "limit_gb": 30.0 + free_gb,
        "source": "ceiling",
    }


def busy(stats: LiveStats, backend_name: str, model_name: str) -> LiveStats:
    """`stats` with one request for the model waiting on the backend."""
    stats.add_waiting(backend_name, model_name)
    return stats


def test_a_cold_model_that_does_not_fit_is_eliminated_with_the_reason() -> None:
    other = model(name="other", loaded=True, vram_gb=30.0)
    snap = fleet_snapshot(
        backend("small", model(size_gb=10.0), other, memory_ceiling_gb=35.0),
        backend("big", model(size_gb=10.0), memory_ceiling_gb=80.0),
    )

    decision = explain(snap, busy(live(), "small", "other"))

    assert decision.chosen is not None and decision.chosen.backend.name == "big"
    [excluded] = decision.excluded
    assert excluded.target.backend.name == "small"
    assert excluded.reasons == (Reason.NO_MEMORY,)
    assert "fit ratio 0.50" in excluded.detail


def test_only_backend_without_memory_gives_a_503_naming_it() -> None:
    other = model(name="other", loaded=True, vram_gb=30.0)
    snap = fleet_snapshot(
        backend("small", model(size_gb=10.0), other, memory_ceiling_gb=35.0)
    )

    decision = explain(snap, busy(live(), "small", "other"))

    assert decision.error is not None and decision.error.status == 503
    assert "without the memory to load it" in str(decision.error)


def test_an_idle_loaded_model_is_unloaded_for_a_cold_one_but_free_memory_wins() -> None:
    # Ollama unloads idle models to make room: "small" can take the model
    # once "other" (idle) goes, but that costs its fit points; "roomy" has
    # the memory free and wins. Alone, "small" serves rather than refusing.
    other = model(name="other", loaded=True, vram_gb=30.0)
    small = backend("small", model(size_gb=10.0), other, memory_ceiling_gb=35.0)
    roomy = backend("roomy", model(size_gb=10.0), memory_ceiling_gb=16.0, priority=90)

    both = explain(fleet_snapshot(small, roomy))
    alone = explain(fleet_snapshot(small))

    assert both.chosen is not None and both.chosen.backend.name == "roomy"
    assert not both.excluded
    assert signals(both)["small"]["memory_fit"]["value"] == 0.5
    assert signals(both)["small"]["memory_fit"]["points"] == 0
    assert alone.chosen is not None and alone.chosen.backend.name == "small"


def test_a_loaded_model_is_never_eliminated_for_memory() -> None:
    b = backend("b", model(loaded=True, vram_gb=40.0), memory_ceiling_gb=20.0)

    assert only(b)["memory_fit"]["points"] == 0


def test_unknown_memory_skips_the_signal_and_never_eliminates() -> None:
    unknown_ceiling = backend("a", model(size_gb=500.0))
    unknown_size = backend("b", model(), memory_ceiling_gb=1.0)
    unknown_use = backend(
        "c", model(size_gb=500.0), model(name="x", loaded=True), memory_ceiling_gb=1.0
    )

    for b in (unknown_ceiling, unknown_size, unknown_use):
        fit = only(b)["memory_fit"]
        assert (fit["value"], fit["points"]) == (None, 0)


# Signals 3 and 4: queue depth and estimated wait --------------------------------


@pytest.mark.parametrize(("depth", "penalty"), [(0, 0), (1, -6), (4, -24), (9, -30)])
def test_queue_penalty_counts_in_flight_and_waiting(depth: int, penalty: int) -> None:
    stats = live()
    b = backend("b")
    for i in range(depth):
        if i % 2:
            stats.add_waiting("b", "m")
        else:
            assert stats.try_begin(b, "m")

    queue = only(b, stats)["queue_depth"]

    assert queue == {"value": depth, "points": penalty}


def test_the_wait_is_guessed_from_model_size_before_enough_samples() -> None:
    stats = live()
    b = backend("b", model(size_gb=40.0))
    stats.add_waiting("b", "m")

    wait = only(b, stats)["estimated_wait"]

    # One request ahead, 2 s + 1 s per GB.
    assert wait == {
        "value": 42.0,
        "source": "heuristic",
        "bandwidth_gbps": None,
        "load_s": 0.0,
        "points": -4.2,
    }


def test_the_guess_uses_the_nodes_bandwidth_learned_from_decoding_speed() -> None:
    stats = live()
    m = model(size_gb=40.0)
    b = backend("b", m)
    stats.add_waiting("b", "m")
    # 400 tokens in 20 s from a 40 GB model: 800 GB/s of weights read, so a
    # 200-token answer takes 10 s there.
    observe_decoding(stats, b, m, 400, 20.0)
    observe_decoding(stats, b, m, 3, 0.01)  # too short to tell: ignored

    wait = only(b, stats)["estimated_wait"]

    assert wait == {
        "value": 12.0,
        "source": "bandwidth",
        "bandwidth_gbps": 800.0,
        "load_s": 0.0,
        "points": -1.2,
    }


def test_a_cold_model_waits_for_its_load_at_the_nodes_learned_load_rate() -> None:
    stats = live()
    cold = model(size_gb=40.0)
    b = backend("b", cold)
    # A warm-up loaded a 40 GB model there in 20 s: 2 GB/s.
    observe_load(stats, b, cold, 20.0)

    wait = only(b, stats)["estimated_wait"]
    hot = only(backend("b", model(size_gb=40.0, loaded=True)), stats)

    assert (wait["value"], wait["load_s"], wait["points"]) == (20.0, 20.0, -2.0)
    assert hot["estimated_wait"]["load_s"] == 0.0  # loaded: nothing to wait for


def test_the_wait_uses_the_p75_latency_once_there_are_enough_samples() -> None:
    stats = live()
    b = backend("b", model(size_gb=40.0))
    for i in range(MIN_LATENCY_SAMPLES):
        # p75 of 1..20 s is 15 s.
        stats.observe_latency("b", (i + 1) * 1000.0, "m")
    for _ in range(3):
        stats.add_waiting("b", "m")

    wait = only(b, stats)["estimated_wait"]

    assert wait == {
        "value": 45.0,
        "source": "p75",
        "bandwidth_gbps": None,
        "load_s": 0.0,
        "points": -4.5,
    }
    for _ in range(20):
        stats.add_waiting("b", "m")
    assert only(b, stats)["estimated_wait"]["points"] == -25  # the cap


# Signal 5: role affinity --------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters_b", "tier", "points"),
    [
        (70.6, "large", 15),
        (70.6, "medium", 5),
        (70.6, "small", 0),
        (8.0, "small", 15),
        (8.0, "medium", 8),
        (8.0, "large", 3),
        (14.0, "medium", 15),
        (14.0, "large", 8),
        (14.0, "small", 3),
        (8.0, "", 0),
        (None, "large", 0),
    ],
)
def test_role_affinity_follows_the_seeds_table(
    parameters_b: float | None, tier: str, points: int
) -> None:
    b = backend("b", model(parameters_b=parameters_b), tier=tier)

    assert only(b)["role_affinity"]["points"] == points


# Signal 6: availability trend ---------------------------------------------------


def test_trend_is_falling_while_load_climbs_and_rising_as_it_drains() -> None:
    stats = live()
    clock = stats.clock
    b = backend("b")
    assert only(b, stats)["trend"] == {"value": "stable", "points": 5}

    for _ in range(4):
        assert stats.try_begin(b, "m")
        clock.now += 1  # type: ignore[attr-defined]
    assert only(b, stats)["trend"] == {"value": "falling", "points": 0}

    clock.now += 300  # type: ignore[attr-defined]  # both views settle at 4
    assert only(b, stats)["trend"]["value"] == "stable"

    for _ in range(4):
        stats.end("b", "m")
    clock.now += 5  # type: ignore[attr-defined]
    assert only(b, stats)["trend"] == {"value": "rising", "points": 10}


def test_trend_is_falling_when_latency_climbs() -> None:
    stats = live()
    for latency in (1000.0,) * 10 + (3000.0,) * 3:
        stats.observe_latency("b", latency, "m")

    assert only(backend("b"), stats)["trend"]["value"] == "falling"


# Signal 7: context fit ----------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "points"), [(0, 10), (500, 10), (700, 6), (1000, 3), (1500, 0)]
)
def test_context_fit_against_the_loaded_window(tokens: int, points: int) -> None:
    # Loaded with a 1000-token window; the model itself accepts 8000.
    b = backend("b", model(loaded=True, loaded_context=1000, context_length=8000))

    fit = only(b, tokens=tokens)["context_fit"]

    assert fit == {"value": {"window": 1000, "tokens": tokens}, "points": points}


def test_context_fit_uses_the_models_window_when_it_is_not_loaded() -> None:
    b = backend("b", model(loaded_context=1000, context_length=8000))

    assert only(b, tokens=1500)["context_fit"]["points"] == 10


def test_unknown_context_skips_the_signal() -> None:
    assert only(backend("b"), tokens=100)["context_fit"]["points"] == 0


# Capacity, settings, explain ------------------------------------------------------


def test_a_backend_at_max_concurrency_stays_a_candidate_under_fleet_only() -> None:
    stats = live()
    full = backend("full", model(loaded=True), max_concurrency=1)
    assert stats.try_begin(full, "m")

    decision = explain(fleet_snapshot(full), stats)
    assert decision.chosen is not None
    assert signals(decision)["full"]["queue_depth"]["points"] == -6

    smart = RouterSnapshot.build(backends=(full,), policy=Policy())
    refused = Router().explain(RequestRequirements(model="m"), smart, stats)
    assert refused.error is not None and refused.error.status == 503


def test_every_constant_comes_from_the_policy() -> None:
    fleet = FleetPolicy(
        hot_points=100, queue_points_per_request=1.0, trend_stable_points=0
    )
    stats = live()
    stats.add_waiting("b", "m")

    found = signals(
        explain(fleet_snapshot(backend("b", model(loaded=True)), fleet=fleet), stats)
    )["b"]

    assert found["thermal"]["points"] == 100
    assert found["queue_depth"]["points"] == -1
    assert found["trend"]["points"] == 0


def test_explain_shows_all_seven_signals_per_candidate() -> None:
    snap = fleet_snapshot(
        backend("a", model(loaded=True, size_gb=5.0, parameters_b=8.0), tier="small"),
        backend("b", model(size_gb=5.0), memory_ceiling_gb=64.0),
    )

    record = explain(snap, tokens=10).as_dict()
    text = render_decision(record, explain=True)

    for candidate in record["candidates"]:
        assert set(candidate["fleet"]) == {  # type: ignore[typeddict-item]
            "thermal",
            "memory_fit",
            "queue_depth",
            "estimated_wait",
            "role_affinity",
            "trend",
            "context_fit",
            "total",
        }
    assert (
        "thermal | memory fit | queue | est. wait | affinity | trend | context" in text
    )
    assert "hot +50" in text and "on_disk +10" in text
    assert "8B/small +15" in text


def test_hold_seconds_follows_the_fleet_preset_unless_set() -> None:
    assert make_policy(strategy="fleet").hold_seconds == 30.0
    assert make_policy(strategy="smart").hold_seconds == 0.0
    explicit = make_policy(strategy="fleet", fleet=FleetPolicy(hold_seconds=5.0))
    assert explicit.hold_seconds == 5.0


def test_the_queue_settings_are_read_on_the_policy_by_name() -> None:
    policy = make_policy(strategy="fleet")

    assert (
        policy.pre_warm_threshold,
        policy.rebalance_threshold,
        policy.rebalance_interval_seconds,
        policy.rebalance_max_moves,
        policy.fleet_queue_length,
        policy.fleet_queue_timeout_seconds,
    ) == (3, 4, 5.0, 3, 100, 60.0)


def test_fleet_settings_out_of_range_are_refused() -> None:
    with pytest.raises(
        ValueError, match="pre_warm_threshold: must be a whole number from 1"
    ):
        FleetPolicy(pre_warm_threshold=0)
    with pytest.raises(ValueError, match="hot_points"):
        FleetPolicy(hot_points=1.5)  # type: ignore[arg-type]


def test_env_overrides_apply_valid_fleet_values_and_ignore_bad_ones() -> None:
    policy = Policy(strategy=Strategy.FLEET)

    changed = apply_overrides(
        policy,
        {
            "NEXUS_ROUTING_FLEET_HOT_POINTS": "80",
            "NEXUS_ROUTING_FLEET_QUEUE_LENGTH": "7",
            "NEXUS_ROUTING_FLEET_HOLD_SECONDS": "2.5",
            "NEXUS_ROUTING_FLEET_WARM_POINTS": "-1",
        },
    )

    assert changed.fleet == replace(
        policy.fleet, hot_points=80, fleet_queue_length=7, hold_seconds=2.5
    )
    assert changed.hold_seconds == 2.5
