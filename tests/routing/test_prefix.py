"""Prefix-aware routing's core: prompt keys, the load-guarded choice, and the
per-process index it reads (routing/core/prefix.py, gateway/prefix.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.prefix import PrefixIndex, find_session
from routing.core import LiveStats, RequestRequirements, Router, RouterSnapshot
from routing.core.prefix import (
    EmptyPrefixView,
    PrefixRequest,
    Signal,
    chain_keys,
    prompt_text,
)
from routing.core.prefix_policy import PrefixPolicy
from tests.routing.core_builders import backend, snapshot

pytestmark = pytest.mark.mode_independent

BLOCK = 16
POLICY = PrefixPolicy(enabled=True, block_chars=BLOCK, cache_blocks=64)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chat(system: str, *turns: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user", "content": turn} for turn in turns]
    return {"model": "m", "messages": messages, **extra}


def request_of(
    index: PrefixIndex,
    body: dict[str, Any],
    policy: PrefixPolicy = POLICY,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> PrefixRequest:
    return index.request_for(body, body, headers or [], policy)


def with_prefix(snap: RouterSnapshot, **changes: Any) -> RouterSnapshot:
    policy = replace(snap.policy, prefix=replace(POLICY, **changes))
    return replace(snap, policy=policy)


def fleet_of(*names: str, strategy: str = "smart", **changes: Any) -> RouterSnapshot:
    return with_prefix(
        snapshot(*(backend(name, "m") for name in names), strategy=strategy),
        **changes,
    )


def route(
    snap: RouterSnapshot,
    prefix: PrefixRequest | None,
    stats: LiveStats | None = None,
    router: Router | None = None,
) -> str:
    chosen = (router or Router()).select(
        RequestRequirements(model="m"), snap, stats or LiveStats(), prefix
    )
    return chosen.target.backend.name


def loaded(**in_flight: int) -> LiveStats:
    stats = LiveStats()
    for name, count in in_flight.items():
        for _ in range(count):
            stats.begin(name)
    return stats


# Prompt keys


def test_block_keys_chain_so_equal_keys_mean_equal_prompts_up_to_there() -> None:
    keys, blocks = chain_keys("a" * 16 + "b" * 16 + "c" * 5, BLOCK)
    assert blocks == 3
    assert len(keys) == 3  # the partial block too: it takes room in a cache
    other, _ = chain_keys("x" * 16 + "b" * 16, BLOCK)
    # The same second block after a different first one: a different key.
    assert other[1] != keys[1]


def test_the_prompt_holds_tools_then_every_message_in_order() -> None:
    body = chat("sys", "one", tools=[{"type": "function", "function": {"name": "f"}}])
    text = prompt_text(body)
    assert text.index('"name":"f"') < text.index("sys") < text.index("one")
    assert prompt_text(chat("sys", "one", "two")).startswith(prompt_text(chat("sys")))


# The index: longest prefix, eviction, sessions


def test_longest_prefix_is_found_over_chained_blocks() -> None:
    index = PrefixIndex()
    long_system = "s" * (BLOCK * 10)
    first = request_of(index, chat(long_system, "q" * BLOCK * 4))
    index.record("m", backend("a", "m"), first, POLICY)
    shorter = request_of(index, chat(long_system[: BLOCK * 6]))
    index.record("m", backend("b", "m"), shorter, POLICY)

    follow_up = request_of(index, chat(long_system, "q" * BLOCK * 4, "more"))
    matched = index.matched_blocks("m", follow_up.keys)
    # All of the first prompt's blocks but its partial last one.
    assert matched["a"] == len(first.keys) - 1
    assert matched["b"] == 6  # the shorter prompt's whole blocks
    assert index.matched_blocks("other-model", follow_up.keys) == {}


def test_a_different_first_message_shares_nothing() -> None:
    index = PrefixIndex()
    common = "c" * (BLOCK * 8)
    index.record("m", backend("a", "m"), request_of(index, chat("A" + common)), POLICY)
    other = request_of(index, chat("B" + common))
    assert index.matched_blocks("m", other.keys) == {}


def test_eviction_follows_the_backends_cache_size() -> None:
    index = PrefixIndex()
    policy = replace(POLICY, cache_blocks=10)
    small = backend("small", "m")
    sized = backend("sized", "m", prefix_cache_tokens=BLOCK * 40 // 4)  # 40 blocks
    prompts = [request_of(index, chat(str(i) * BLOCK * 8), policy) for i in range(4)]
    for prompt in prompts:  # 9 blocks each (the role's few characters spill over)
        assert len(prompt.keys) == 9
        index.record("m", small, prompt, policy)
        index.record("m", sized, prompt, policy)
    assert index.held_blocks("m", "small") == 10
    assert index.held_blocks("m", "sized") == 36
    newest = index.matched_blocks("m", prompts[-1].keys)
    assert newest == {"small": 9, "sized": 9}
    # The second newest lost its tail first: its head is still matched.
    assert index.matched_blocks("m", prompts[-2].keys) == {"small": 1, "sized": 9}
    assert index.matched_blocks("m", prompts[0].keys) == {"sized": 9}


def test_a_session_sticks_until_its_time_to_live_runs_out() -> None:
    clock = Clock()
    index = PrefixIndex(clock=clock)
    policy = replace(POLICY, session_ttl_seconds=60)
    headers = [(b"x-session-id", b"s-1")]
    asked = request_of(index, chat("hi"), policy, headers)
    assert asked.session == "s-1"
    index.record("m", backend("b", "m"), asked, policy)
    clock.now += 59
    assert index.session_backend("m", "s-1") == "b"
    clock.now += 1
    assert index.session_backend("m", "s-1") is None


def test_any_json_text_is_keyed_a_lone_surrogate_too() -> None:
    index = PrefixIndex()
    odd = request_of(index, chat("\ud800" * BLOCK * 2, tools=[{"x": "\udfff"}]))
    assert len(odd.keys) == odd.prompt_blocks > 2


def test_session_keys_are_read_from_headers_and_body_fields_in_order() -> None:
    keys = ("x-session-id", "user", "metadata.user_id")
    assert find_session(keys, {"user": "u"}, [(b"x-session-id", b"h")]) == "h"
    assert find_session(keys, {"user": "u"}, []) == "u"
    assert find_session(keys, {"metadata": {"user_id": "anth"}}, []) == "anth"
    assert find_session(keys, {"user": 5}, []) is None


# The choice


def test_a_prompt_goes_back_to_the_backend_holding_its_prefix() -> None:
    index = PrefixIndex()
    snap = fleet_of("a", "b", "c")
    prompt = request_of(index, chat("p" * BLOCK * 6))
    index.record("m", snap.backends_by_name["c"], prompt, POLICY)
    decision = Router().explain(
        RequestRequirements(model="m"), snap, LiveStats(), prompt
    )
    assert decision.chosen is not None and decision.chosen.backend.name == "c"
    assert decision.prefix is not None
    assert decision.prefix.signal is Signal.PREFIX
    assert decision.prefix.reason() == "prefix; blocks=7/7"
    assert decision.as_dict()["prefix"]["matched_blocks"] == 7  # type: ignore[index]


@pytest.mark.parametrize(
    ("max_imbalance", "ratio", "home_load", "expected"),
    [
        (2, 0.0, 2, "c"),  # 2 more than the least: within the guard
        (2, 0.0, 3, "a"),  # 3 more: the guard sends it to the strategy's choice
        (0, 0.0, 1, "a"),
        (5, 0.0, 5, "c"),
    ],
)
def test_the_load_guard_overrides_the_prefix_at_the_configured_imbalance(
    max_imbalance: int, ratio: float, home_load: int, expected: str
) -> None:
    index = PrefixIndex()
    snap = fleet_of(
        "a", "b", "c", max_imbalance=max_imbalance, max_imbalance_ratio=ratio
    )
    prompt = request_of(index, chat("p" * BLOCK * 6))
    index.record("m", snap.backends_by_name["c"], prompt, POLICY)
    stats = loaded(c=home_load)
    # Refused: the strategy's choice among the idle ones (a or b).
    assert route(snap, prompt, stats) in ({"c"} if expected == "c" else {"a", "b"})
    decision = Router().explain(RequestRequirements(model="m"), snap, stats, prompt)
    assert decision.prefix is not None
    if expected != "c":
        assert decision.prefix.signal is Signal.LOAD_GUARD
        assert decision.prefix.overridden == "c"
        assert "refused=c" in decision.prefix.reason()


def test_the_ratio_guard_allows_more_when_everyone_is_busy() -> None:
    index = PrefixIndex()
    snap = fleet_of("a", "c", max_imbalance=2, max_imbalance_ratio=0.5)
    prompt = request_of(index, chat("p" * BLOCK * 6))
    index.record("m", snap.backends_by_name["c"], prompt, POLICY)
    assert route(snap, prompt, loaded(a=10, c=15)) == "c"  # 5 <= 50 % of 10
    assert route(snap, prompt, loaded(a=10, c=16)) == "a"


def test_under_fleet_the_guard_counts_queue_depth() -> None:
    index = PrefixIndex()
    snap = fleet_of("a", "c", strategy="fleet", max_imbalance=1, max_imbalance_ratio=0)
    prompt = request_of(index, chat("p" * BLOCK * 6))
    index.record("m", snap.backends_by_name["c"], prompt, POLICY)
    stats = LiveStats()
    assert route(snap, prompt, stats) == "c"
    assert stats.try_begin(snap.backends_by_name["c"], "m")
    stats.add_waiting("c", "m")  # depth 2 against 0
    assert route(snap, prompt, stats) == "a"


def test_among_equal_matches_the_strategys_order_decides() -> None:
    index = PrefixIndex()
    snap = fleet_of("a", "b", "c")
    prompt = request_of(index, chat("p" * BLOCK * 6))
    index.record("m", snap.backends_by_name["b"], prompt, POLICY)
    index.record("m", snap.backends_by_name["c"], prompt, POLICY)
    # Smart prefers the less loaded of the two holders.
    assert route(snap, prompt, loaded(b=1)) == "c"
    assert route(snap, prompt, loaded(c=1)) == "b"


def test_round_robin_takes_the_prefix_first_and_rotates_otherwise() -> None:
    index = PrefixIndex()
    snap = fleet_of("a", "b", "c", strategy="round_robin")
    router = Router()
    held = request_of(index, chat("p" * BLOCK * 6))
    index.record("m", snap.backends_by_name["b"], held, POLICY)
    assert [route(snap, held, router=router) for _ in range(3)] == ["b"] * 3
    cold = request_of(index, chat("q" * BLOCK * 6))
    assert [route(snap, cold, router=router) for _ in range(3)] == ["a", "b", "c"]


def test_a_session_sticks_to_its_backend_under_the_guard() -> None:
    index = PrefixIndex()
    snap = fleet_of("a", "b", max_imbalance=1, max_imbalance_ratio=0)
    headers = [(b"x-session-id", b"s")]
    first = request_of(index, chat("short"), headers=headers)
    index.record("m", snap.backends_by_name["b"], first, POLICY)
    again = request_of(index, chat("other"), headers=headers)
    decision = Router().explain(
        RequestRequirements(model="m"), snap, loaded(b=1), again
    )
    assert decision.chosen is not None and decision.chosen.backend.name == "b"
    assert decision.prefix is not None and decision.prefix.signal is Signal.SESSION
    assert route(snap, again, loaded(b=2)) == "a"


def test_every_process_places_a_new_prompt_alike_among_the_least_busy() -> None:
    snap = fleet_of("a", "b", "c", "d")
    prompts = [chat(f"tenant {n} " + "s" * BLOCK * 4) for n in range(40)]
    # Two serving processes, each with an index of its own.
    first = [route(snap, request_of(PrefixIndex(), body)) for body in prompts]
    second = [route(snap, request_of(PrefixIndex(), body)) for body in prompts]
    assert first == second
    assert set(first) == {"a", "b", "c", "d"}  # spread, not all on the first
    # Never a busier backend than the strategy's choice, nor another priority.
    assert (
        route(snap, request_of(PrefixIndex(), prompts[0]), loaded(a=1, b=1, c=1)) == "d"
    )
    ranked = with_prefix(
        snapshot(backend("a", "m", priority=1), *(backend(n, "m") for n in "bcd"))
    )
    assert {route(ranked, request_of(PrefixIndex(), body)) for body in prompts} == {"a"}
    # Round robin keeps its turn.
    rotating = fleet_of("a", "b", "c", "d", strategy="round_robin")
    router = Router()
    turns = [
        route(rotating, request_of(PrefixIndex(), b), router=router)
        for b in prompts[:4]
    ]
    assert turns == ["a", "b", "c", "d"]


def test_an_unknown_block_size_or_bad_settings_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="block_chars must be within 16..65536"):
        PrefixPolicy(block_chars=8)
    with pytest.raises(ValueError, match="session_keys must be comma-separated"):
        PrefixPolicy(session_keys="x-session id")
    with pytest.raises(ValueError, match="max_imbalance_ratio"):
        PrefixPolicy(max_imbalance_ratio=float("nan"))


# Disabled (or nothing matched) changes nothing


@st.composite
def fleets(draw: st.DrawFn) -> tuple[RouterSnapshot, LiveStats]:
    count = draw(st.integers(1, 6))
    strategy = draw(st.sampled_from(["smart", "fleet", "round_robin", "priority_only"]))
    backends = [
        backend(
            f"b{i}",
            "m",
            priority=draw(st.integers(0, 3)),
            avg_latency_ms=draw(st.one_of(st.none(), st.floats(0, 2000))),
            max_concurrency=draw(st.one_of(st.none(), st.integers(1, 4))),
        )
        for i in range(count)
    ]
    snap = snapshot(*backends, strategy=strategy)
    stats = LiveStats()
    for spec in backends:
        for _ in range(draw(st.integers(0, 5))):
            stats.try_begin(spec, "m")  # in flight, and in the fleet's depth
    return snap, stats


@settings(max_examples=150, deadline=None)
@given(fleet=fleets())
def test_disabled_prefix_routing_changes_no_decision(
    fleet: tuple[RouterSnapshot, LiveStats],
) -> None:
    snap, stats = fleet
    keys, blocks = chain_keys("z" * 200, BLOCK)
    prefix = PrefixRequest(keys, blocks, None, EmptyPrefixView(), anchor=7)
    changed = with_prefix(snap, enabled=False)
    needs = RequestRequirements(model="m")
    before = Router().explain(needs, snap, stats)
    after = Router().explain(needs, changed, stats, prefix)
    assert after.chosen == before.chosen
    assert after.retry_order == before.retry_order
    assert after.error.__class__ is before.error.__class__
    assert after.prefix is None


@settings(max_examples=150, deadline=None)
@given(fleet=fleets(), anchor=st.integers(0, 2**32))
def test_a_new_prompt_never_goes_busier_or_lower_than_the_strategys_choice(
    fleet: tuple[RouterSnapshot, LiveStats], anchor: int
) -> None:
    snap, stats = fleet
    keys, blocks = chain_keys("z" * 200, BLOCK)
    prefix = PrefixRequest(keys, blocks, None, EmptyPrefixView(), anchor=anchor)
    needs = RequestRequirements(model="m")
    before = Router().explain(needs, snap, stats)
    after = Router().explain(needs, with_prefix(snap), stats, prefix)
    if before.chosen is None:
        assert after.chosen is None
        return
    assert after.chosen is not None and after.prefix is not None
    assert after.prefix.signal is Signal.STRATEGY
    if snap.policy.strategy.value not in ("smart", "fleet"):
        assert after.chosen == before.chosen

    def load(name: str) -> int:
        # The load the guard reads: queue depth under fleet, else in flight.
        if snap.policy.strategy.value == "fleet":
            return stats.queue_depth(name, "m")
        return stats.in_flight_counts.get(name, 0)

    assert load(after.chosen.backend.name) <= load(before.chosen.backend.name)
    assert after.chosen.backend.priority == before.chosen.backend.priority
