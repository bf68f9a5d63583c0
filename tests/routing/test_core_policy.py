"""The routing policy and its environment overrides (routing/core/policy.py)."""

from __future__ import annotations

import logging

import pytest

from routing.core import (
    MAX_RETRIES_ENV,
    STRATEGY_ENV,
    BackendSpec,
    LiveStats,
    ModelSpec,
    Policy,
    RequestRequirements,
    Router,
    RouterSnapshot,
    Strategy,
    apply_overrides,
    make_policy,
)
from routing.core import policy as policy_module

pytestmark = pytest.mark.mode_independent


@pytest.fixture(autouse=True)
def _forget_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy_module, "_warned", set())


def test_policy_defaults_are_the_spec_defaults() -> None:
    policy = make_policy()
    assert policy.strategy is Strategy.SMART
    assert (policy.weights.priority, policy.weights.load, policy.weights.latency) == (
        50,
        30,
        20,
    )
    assert policy.max_retries == 2


def test_policy_takes_the_stored_fields() -> None:
    policy = make_policy(
        strategy="round_robin",
        weight_priority=20,
        weight_load=60,
        weight_latency=20,
        max_retries=4,
    )
    assert policy.strategy is Strategy.ROUND_ROBIN
    assert policy.weights.load == 60
    assert policy.max_retries == 4


def test_unknown_strategy_falls_back_to_smart_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="routing.core.policy"):
        policies = [make_policy(strategy="fastest") for _ in range(5)]
    assert {p.strategy for p in policies} == {Strategy.SMART}
    warnings = [r for r in caplog.records if "fastest" in r.getMessage()]
    assert len(warnings) == 1
    assert "using 'smart'" in warnings[0].getMessage()


def test_unknown_strategy_routes_with_smart() -> None:
    stats = LiveStats()
    for _ in range(20):
        stats.begin("busy")
    snap = RouterSnapshot.build(
        backends=[
            BackendSpec(
                name=name,
                base_url="http://h",
                status="healthy",
                models=(ModelSpec("m"),),
            )
            for name in ("busy", "idle")
        ],
        policy=make_policy(strategy="least_connections"),
    )
    route = Router().select(RequestRequirements(model="m"), snap, stats)
    assert route.decision.strategy is Strategy.SMART
    assert route.target.backend.name == "idle"


def test_env_overrides_strategy_and_max_retries() -> None:
    stored = make_policy(strategy="smart", max_retries=2)
    policy = apply_overrides(
        stored, {STRATEGY_ENV: "round_robin", MAX_RETRIES_ENV: "3"}
    )
    assert policy.strategy is Strategy.ROUND_ROBIN
    assert policy.max_retries == 3
    assert policy.weights == stored.weights


def test_env_strategy_is_case_and_space_insensitive() -> None:
    policy = apply_overrides(make_policy(), {STRATEGY_ENV: "  Priority_Only "})
    assert policy.strategy is Strategy.PRIORITY_ONLY


def test_empty_or_missing_env_keeps_the_stored_policy() -> None:
    stored = make_policy(strategy="random", max_retries=5)
    assert apply_overrides(stored, {}) == stored
    assert apply_overrides(stored, {STRATEGY_ENV: "", MAX_RETRIES_ENV: " "}) == stored


def test_unknown_env_strategy_means_smart_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stored = make_policy(strategy="round_robin")
    with caplog.at_level(logging.WARNING, logger="routing.core.policy"):
        for _ in range(3):
            policy = apply_overrides(stored, {STRATEGY_ENV: "weighted"})
    assert policy.strategy is Strategy.SMART
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert STRATEGY_ENV in messages[0]


@pytest.mark.parametrize("value", ["three", "-1", "11", "2.5"])
def test_invalid_env_max_retries_is_ignored_with_a_warning(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    stored = make_policy(max_retries=2)
    with caplog.at_level(logging.WARNING, logger="routing.core.policy"):
        policy = apply_overrides(stored, {MAX_RETRIES_ENV: value})
    assert policy.max_retries == 2
    expected = (
        f"Ignoring {MAX_RETRIES_ENV}={value!r}: use a whole number from 0 to 10; "
        "keeping 2"
    )
    assert [r.getMessage() for r in caplog.records] == [expected]


def test_zero_retries_from_env_is_honoured() -> None:
    assert apply_overrides(make_policy(), {MAX_RETRIES_ENV: "0"}).max_retries == 0


def test_policy_rejects_out_of_range_retries() -> None:
    with pytest.raises(ValueError, match="max_retries"):
        Policy(max_retries=11)


def test_policy_rejects_weights_not_summing_to_100() -> None:
    with pytest.raises(ValueError, match="sum to 100"):
        make_policy(weight_priority=50, weight_load=50, weight_latency=50)
