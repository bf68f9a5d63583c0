"""The fleet scheduler's pure core: lines and slots, rebalance plans, pre-warm locks."""

from __future__ import annotations

import pytest

from gateway.fleet.prewarm import PrewarmBook
from gateway.fleet.queues import FleetQueues, Waiter, has_free_slot
from gateway.fleet.rebalance import LineLoad, Move, Opening, plan_rebalance
from gateway.fleet.settings import FleetSettings
from routing.core.fleet_policy import FleetPolicy
from routing.core.policy import Policy
from routing.core.vocabulary import Strategy

pytestmark = pytest.mark.mode_independent


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_line_is_first_in_first_out_and_bounded() -> None:
    queues = FleetQueues()
    first, second, third = (Waiter("a", "m", float(t)) for t in range(3))
    assert queues.join(first, max_length=2)
    assert queues.join(second, max_length=2)
    assert not queues.join(third, max_length=2)
    assert queues.waiting("a", "m") == 2
    assert queues.pop_next("a", lambda model: True) is first
    assert queues.pop_next("a", lambda model: True) is second
    assert queues.pop_next("a", lambda model: True) is None
    assert list(queues.lines()) == []


def test_the_oldest_waiter_on_a_backend_whose_model_has_room_goes_first() -> None:
    queues = FleetQueues()
    old_big = Waiter("a", "big", 1.0)
    young_small = Waiter("a", "small", 2.0)
    queues.join(old_big, 10)
    queues.join(young_small, 10)
    # "big" is at its own limit: the slot goes to the younger "small" request.
    assert queues.pop_next("a", lambda model: model != "big") is young_small
    assert queues.pop_next("a", lambda model: True) is old_big


def test_a_waiter_that_leaves_frees_its_place() -> None:
    queues = FleetQueues()
    gone, stays = Waiter("a", "m", 1.0), Waiter("a", "m", 2.0)
    queues.join(gone, 2)
    queues.join(stays, 2)
    assert queues.leave(gone)
    assert not queues.leave(gone)
    assert queues.join(Waiter("a", "m", 3.0), 2)
    assert queues.pop_next("a", lambda model: True) is stays


def test_reserved_slots_count_against_capacity() -> None:
    queues = FleetQueues()
    queues.reserve("a", "m")
    assert queues.reserved("a") == 1
    assert queues.reserved_for("a", "m") == 1
    assert not has_free_slot(in_flight=1, reserved=queues.reserved("a"), capacity=2)
    queues.unreserve("a", "m")
    assert has_free_slot(in_flight=1, reserved=queues.reserved("a"), capacity=2)


def test_rebalance_moves_at_most_the_cap_per_cycle() -> None:
    lines = [LineLoad("busy", "m", in_flight=2, waiting=8)]
    openings = [Opening("hot", "m", free=10)]
    moves = plan_rebalance(lines, openings, threshold=4, max_moves=3)
    assert moves == [Move("busy", "hot", "m")] * 3


def test_rebalance_only_moves_to_hot_openings_of_the_same_model() -> None:
    lines = [LineLoad("busy", "m", in_flight=2, waiting=8)]
    # The glue offers only hot places; another model's room is not this one's.
    openings = [Opening("other", "x", free=5), Opening("busy", "m", free=5)]
    assert plan_rebalance(lines, openings, threshold=4, max_moves=3) == []


def test_rebalance_leaves_lines_at_or_under_the_threshold() -> None:
    lines = [
        LineLoad("a", "m", in_flight=2, waiting=2),  # depth 4: not deeper than 4
        LineLoad("b", "m", in_flight=2, waiting=4),  # depth 6: two moves
    ]
    openings = [Opening("hot", "m", free=5)]
    moves = plan_rebalance(lines, openings, threshold=4, max_moves=5)
    assert moves == [Move("b", "hot", "m")] * 2


def test_rebalance_takes_no_more_than_an_opening_has_room_for() -> None:
    lines = [LineLoad("busy", "m", in_flight=2, waiting=8)]
    openings = [Opening("hot1", "m", free=1), Opening("hot2", "m", free=1)]
    moves = plan_rebalance(lines, openings, threshold=4, max_moves=3)
    assert sorted(m.destination for m in moves) == ["hot1", "hot2"]


def test_rebalance_serves_the_deepest_line_first() -> None:
    lines = [
        LineLoad("a", "m", in_flight=1, waiting=5),
        LineLoad("b", "m", in_flight=2, waiting=7),
    ]
    moves = plan_rebalance(
        lines, [Opening("hot", "m", free=1)], threshold=4, max_moves=3
    )
    assert moves == [Move("b", "hot", "m")]


def test_prewarm_fires_once_past_the_threshold_and_not_while_running() -> None:
    book = PrewarmBook(Clock(), remember_seconds=300)
    assert not book.should_warm(3, 3, "b", "m", is_hot=False)  # not past it
    assert book.should_warm(4, 3, "b", "m", is_hot=False)
    book.begin("b", "m")
    assert not book.should_warm(9, 3, "b", "m", is_hot=False)  # the lock
    assert book.should_warm(9, 3, "c", "m", is_hot=False)  # another backend


def test_prewarm_skips_a_hot_runner_up() -> None:
    book = PrewarmBook(Clock(), remember_seconds=300)
    assert not book.should_warm(10, 3, "b", "m", is_hot=True)


def test_a_warmed_model_is_not_warmed_again_until_it_may_have_expired() -> None:
    clock = Clock()
    book = PrewarmBook(clock, remember_seconds=300)
    book.begin("b", "m")
    book.finish("b", "m", loaded=True)
    clock.now += 299
    assert not book.should_warm(10, 3, "b", "m", is_hot=False)
    clock.now += 1
    assert book.should_warm(10, 3, "b", "m", is_hot=False)


def test_a_failed_warm_up_may_be_tried_again() -> None:
    book = PrewarmBook(Clock(), remember_seconds=300)
    book.begin("b", "m")
    book.finish("b", "m", loaded=False)
    assert book.should_warm(10, 3, "b", "m", is_hot=False)


def test_settings_read_the_policy_with_the_seed_defaults() -> None:
    assert FleetSettings.from_policy(Policy()) == FleetSettings(enabled=False)
    preset = FleetSettings.from_policy(Policy(strategy=Strategy.FLEET))
    assert preset.enabled
    assert preset.hold_seconds == 30  # the fleet preset
    settings = FleetSettings.from_policy(
        Policy(
            strategy=Strategy.FLEET,
            fleet=FleetPolicy(hold_seconds=0, fleet_queue_length=5),
        )
    )
    assert settings.hold_seconds == 0
    assert settings.queue_length == 5
    assert settings.pre_warm_threshold == 3
    assert settings.rebalance_max_moves == 3
