"""Scoring and the four strategies (routing/core/scoring.py, strategies.py)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.core import (
    BackendSpec,
    LiveStats,
    ModelSpec,
    RequestRequirements,
    Router,
    RouterSnapshot,
    ScoringWeights,
    make_policy,
    score_backend,
)

pytestmark = pytest.mark.mode_independent

MODEL = "llama3:8b"


def backend(
    name: str, *, priority: int = 10, latency: float | None = None
) -> BackendSpec:
    return BackendSpec(
        name=name,
        base_url=f"http://{name}:11434",
        status="healthy",
        priority=priority,
        avg_latency_ms=latency,
        models=(ModelSpec(MODEL),),
    )


def snapshot(*backends: BackendSpec, strategy: str = "smart") -> RouterSnapshot:
    return RouterSnapshot.build(
        version=1, backends=backends, policy=make_policy(strategy=strategy)
    )


def pick(
    snap: RouterSnapshot, router: Router | None = None, stats: LiveStats | None = None
) -> str:
    route = (router or Router()).select(
        RequestRequirements(model=MODEL), snap, stats or LiveStats()
    )
    return route.target.backend.name


def test_default_weights_are_the_spec_defaults() -> None:
    assert ScoringWeights() == ScoringWeights(priority=50, load=30, latency=20)


def test_score_follows_the_spec_formula() -> None:
    score = score_backend(
        priority=20, pending=10, latency_ms=150.0, weights=ScoringWeights()
    )
    assert score.priority == 80
    assert score.load == 90
    assert score.latency == 85
    assert score.total == pytest.approx((80 * 50 + 90 * 30 + 85 * 20) / 100)


def test_weights_change_what_matters() -> None:
    latency_only = ScoringWeights(priority=0, load=0, latency=100)
    fast = score_backend(90, 50, 10.0, latency_only)
    slow = score_backend(0, 0, 900.0, latency_only)
    assert fast.total > slow.total


@pytest.mark.parametrize(
    "weights",
    [(50, 30, 30), (100, 10, -10), (0, 0, 0)],
    ids=["sum-110", "negative", "zero"],
)
def test_weights_that_do_not_sum_to_100_are_rejected(
    weights: tuple[int, int, int],
) -> None:
    with pytest.raises(ValueError, match="sum to 100"):
        ScoringWeights(*weights)


def test_priority_above_100_is_clamped_to_100() -> None:
    assert score_backend(250, 0, None, ScoringWeights()).priority == 0
    assert score_backend(250, 0, None, ScoringWeights()) == score_backend(
        100, 0, None, ScoringWeights()
    )


def test_pending_requests_above_100_are_clamped_to_100() -> None:
    assert score_backend(0, 500, None, ScoringWeights()).load == 0
    assert score_backend(0, 500, None, ScoringWeights()) == score_backend(
        0, 100, None, ScoringWeights()
    )


def test_no_latency_data_scores_as_zero_ms() -> None:
    assert score_backend(0, 0, None, ScoringWeights()).latency == 100
    assert score_backend(0, 0, None, ScoringWeights()) == score_backend(
        0, 0, 0.0, ScoringWeights()
    )


def test_latency_of_a_second_or_more_scores_zero() -> None:
    assert score_backend(0, 0, 1000.0, ScoringWeights()).latency == 0
    assert score_backend(0, 0, 60_000.0, ScoringWeights()).latency == 0


def test_small_load_differences_are_not_lost_to_rounding() -> None:
    one = score_backend(10, 1, None, ScoringWeights())
    three = score_backend(10, 3, None, ScoringWeights())
    assert one.total > three.total


weights_strategy = (
    st.tuples(st.integers(0, 100), st.integers(0, 100))
    .filter(lambda pair: sum(pair) <= 100)
    .map(lambda pair: ScoringWeights(pair[0], pair[1], 100 - pair[0] - pair[1]))
)


@given(
    priority=st.integers(-(10**12), 10**12),
    pending=st.integers(-(10**6), 10**12),
    latency=st.none() | st.floats(allow_nan=True, allow_infinity=True),
    weights=weights_strategy,
)
def test_score_is_always_within_0_and_100(
    priority: int, pending: int, latency: float | None, weights: ScoringWeights
) -> None:
    score = score_backend(priority, pending, latency, weights)
    for part in score:
        assert 0 <= part <= 100
        assert not math.isnan(part)


# Smart strategy


def test_smart_prefers_the_less_loaded_backend() -> None:
    """AC-06: A has 10 requests in flight and B 2; B is chosen."""
    stats = LiveStats()
    for _ in range(10):
        stats.begin("a")
    for _ in range(2):
        stats.begin("b")
    snap = snapshot(backend("a"), backend("b"))
    route = Router().select(RequestRequirements(model=MODEL), snap, stats)
    scores = {c.target.backend.name: c.score.total for c in route.decision.candidates}
    assert scores["b"] > scores["a"]
    assert route.target.backend.name == "b"


def test_lower_latency_backend_scores_higher() -> None:
    """AC-06: A averages 50 ms and B 200 ms; A scores higher."""
    snap = snapshot(backend("b", latency=200.0), backend("a", latency=50.0))
    route = Router().select(RequestRequirements(model=MODEL), snap, LiveStats())
    scores = {c.target.backend.name: c.score for c in route.decision.candidates}
    assert scores["a"].latency == 95
    assert scores["b"].latency == 80
    assert scores["a"].total > scores["b"].total
    assert route.target.backend.name == "a"


def test_smart_selects_the_highest_scoring_backend() -> None:
    """AC-11."""
    stats = LiveStats()
    for _ in range(40):
        stats.begin("busy-but-first")
    snap = snapshot(
        backend("busy-but-first", priority=0),
        backend("slow", priority=5, latency=900.0),
        backend("balanced", priority=5, latency=30.0),
    )
    route = Router().select(RequestRequirements(model=MODEL), snap, stats)
    best = max(route.decision.candidates, key=lambda c: c.score.total)
    assert route.target.backend.name == best.target.backend.name == "balanced"


def test_all_backends_with_the_same_score_go_to_the_first_candidate() -> None:
    snap = snapshot(backend("c"), backend("a"), backend("b"))
    router = Router()
    assert {pick(snap, router) for _ in range(10)} == {"a"}  # stable order: by name


def test_stable_order_is_by_priority_then_name() -> None:
    snap = snapshot(backend("a", priority=5), backend("z", priority=1))
    assert [b.name for b in snap.backends] == ["z", "a"]


def test_smart_spreads_load_as_requests_stay_in_flight() -> None:
    snap = snapshot(backend("a"), backend("b"), backend("c"))
    router, stats = Router(), LiveStats()
    chosen = []
    for _ in range(9):
        name = pick(snap, router, stats)
        stats.begin(name)  # the proxy counts the request until it finishes
        chosen.append(name)
    assert Counter(chosen) == {"a": 3, "b": 3, "c": 3}


@given(
    priorities=st.lists(st.integers(0, 200), min_size=1, max_size=12),
    data=st.data(),
)
def test_smart_always_picks_a_backend_with_the_maximal_score(
    priorities: list[int], data: st.DataObject
) -> None:
    stats = LiveStats()
    backends = []
    for index, priority in enumerate(priorities):
        name = f"b{index:02d}"
        latency = data.draw(st.none() | st.floats(0, 5000), label=f"latency {name}")
        backends.append(backend(name, priority=priority, latency=latency))
        for _ in range(data.draw(st.integers(0, 120), label=f"in flight {name}")):
            stats.begin(name)
    snap = snapshot(*backends)
    route = Router().select(RequestRequirements(model=MODEL), snap, stats)
    candidates = route.decision.candidates
    best_total = max(c.score.total for c in candidates)
    chosen = next(c for c in candidates if c.target == route.target)
    assert chosen.score.total == pytest.approx(best_total)
    # Ties go to the first candidate in stable order.
    first_best = next(c for c in candidates if c.score.total == best_total)
    assert chosen is first_best
    # The router's inlined arithmetic agrees with score_backend().
    served = route.decision.served
    assert served is not None
    assert list(served.totals) == pytest.approx([c.score.total for c in candidates])


# Round robin


def test_round_robin_gives_each_of_three_backends_two_of_six_requests() -> None:
    """AC-12."""
    snap = snapshot(backend("a"), backend("b"), backend("c"), strategy="round_robin")
    router = Router()
    assert Counter(pick(snap, router) for _ in range(6)) == {"a": 2, "b": 2, "c": 2}


def test_round_robin_rotates_in_stable_order() -> None:
    snap = snapshot(backend("b"), backend("a"), strategy="round_robin")
    router = Router()
    assert [pick(snap, router) for _ in range(4)] == ["a", "b", "a", "b"]


def test_round_robin_ignores_load_and_latency() -> None:
    stats = LiveStats()
    for _ in range(50):
        stats.begin("a")
    snap = snapshot(backend("a"), backend("b", latency=900.0), strategy="round_robin")
    router = Router()
    assert [pick(snap, router, stats) for _ in range(4)] == ["a", "b", "a", "b"]


def test_round_robin_keeps_a_separate_rotation_per_model() -> None:
    both = (ModelSpec("x"), ModelSpec("y"))
    snap = RouterSnapshot.build(
        backends=[
            BackendSpec(name=n, base_url="http://h", status="healthy", models=both)
            for n in ("a", "b")
        ],
        policy=make_policy(strategy="round_robin"),
    )
    router, stats = Router(), LiveStats()
    picks: dict[str, list[str]] = {"x": [], "y": []}
    for _ in range(4):
        for model in ("x", "y"):
            route = router.select(RequestRequirements(model=model), snap, stats)
            picks[model].append(route.target.backend.name)
    assert picks == {"x": ["a", "b", "a", "b"], "y": ["a", "b", "a", "b"]}


@given(backends=st.integers(1, 12), rounds=st.integers(1, 12))
def test_round_robin_gives_each_of_n_backends_exactly_k_of_k_times_n_requests(
    backends: int, rounds: int
) -> None:
    snap = snapshot(
        *(backend(f"b{i:02d}") for i in range(backends)), strategy="round_robin"
    )
    router = Router()
    counts = Counter(pick(snap, router) for _ in range(backends * rounds))
    assert len(counts) == backends
    assert set(counts.values()) == {rounds}


# Priority only


def test_priority_only_sends_everything_to_the_lowest_priority_number() -> None:
    """AC-13."""
    stats = LiveStats()
    for _ in range(90):
        stats.begin("primary")  # load does not matter to this strategy
    snap = snapshot(
        backend("primary", priority=1),
        backend("secondary", priority=2, latency=1.0),
        strategy="priority_only",
    )
    router = Router()
    assert {pick(snap, router, stats) for _ in range(20)} == {"primary"}


def test_priority_only_rotates_among_backends_with_equal_priority() -> None:
    snap = snapshot(
        backend("a", priority=1),
        backend("b", priority=1),
        backend("c", priority=2),
        strategy="priority_only",
    )
    router = Router()
    assert Counter(pick(snap, router) for _ in range(10)) == {"a": 5, "b": 5}


# Random


def test_random_spreads_100_requests_over_3_backends_roughly_evenly() -> None:
    """AC-14: each backend gets 25..45 of 100 (seeded, so repeatable)."""
    snap = snapshot(backend("a"), backend("b"), backend("c"), strategy="random")
    router = Router(rng=random.Random(20240601))
    counts = Counter(pick(snap, router) for _ in range(100))
    assert set(counts) == {"a", "b", "c"}
    assert all(25 <= n <= 45 for n in counts.values()), counts


def test_random_is_uniform_over_many_requests() -> None:
    snap = snapshot(backend("a"), backend("b"), backend("c"), strategy="random")
    router = Router(rng=random.Random(7))
    counts = Counter(pick(snap, router) for _ in range(30_000))
    assert all(abs(n - 10_000) < 500 for n in counts.values()), counts


def test_random_uses_the_injected_generator() -> None:
    snap = snapshot(*(backend(f"b{i}") for i in range(5)), strategy="random")
    first = [pick(snap, Router(rng=random.Random(3))) for _ in range(1)]
    runs = [
        [pick(snap, router) for _ in range(20)]
        for router in (Router(rng=random.Random(3)), Router(rng=random.Random(3)))
    ]
    assert runs[0] == runs[1]
    assert runs[0][0] == first[0]
    assert len(set(runs[0])) > 1
