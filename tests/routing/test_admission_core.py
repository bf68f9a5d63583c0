"""The admission core on a simulated clock: fairness, bounds, expiry, preemption.

No Django, no event loop: the controller is driven by hand, with a fake clock,
and a "backend" that finishes the oldest request it holds at each tick.
"""

from __future__ import annotations

from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.admission import (
    AdmissionController,
    AdmissionError,
    AdmissionSettings,
    Criticality,
    FairRequestQueue,
    FlowQueueFull,
    Outcome,
    QueueFull,
    StockUnit,
    Ticket,
    error_of,
)

pytestmark = pytest.mark.mode_independent

GO = (Outcome.BYPASSED, Outcome.DISPATCHED)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Sim:
    """A controller over one pool, and a backend that serves in arrival order."""

    def __init__(self, ready: int = 1, **knobs: object) -> None:
        self.clock = Clock()
        knobs.setdefault("watermark_per_backend", 1)
        self.controller = AdmissionController(
            AdmissionSettings(**knobs),  # type: ignore[arg-type]
            clock=self.clock,
        )
        self.ready = ready
        self.in_flight: deque[Ticket] = deque()
        self.served: list[Ticket] = []
        self.refused: list[tuple[Ticket, AdmissionError]] = []
        self.decided: list[Ticket] = []

    def submit(self, flow: str, **fields: object) -> Ticket:
        ticket = Ticket(flow=flow, on_done=self._on_done, **fields)  # type: ignore[arg-type]
        try:
            self.controller.admit(ticket, "pool", self.ready)
        except AdmissionError as error:
            self.refused.append((ticket, error))
            return ticket
        if ticket.outcome in GO:
            self._start(ticket)
        return ticket

    def finish_oldest(self) -> None:
        if self.in_flight:
            self.controller.release(self.in_flight.popleft())

    def _on_done(self, ticket: Ticket) -> None:
        self.decided.append(ticket)
        if ticket.outcome is Outcome.DISPATCHED:
            self._start(ticket)

    def _start(self, ticket: Ticket) -> None:
        self.in_flight.append(ticket)
        self.served.append(ticket)

    def share(self, skip: int = 0) -> Counter[str]:
        return Counter(ticket.flow for ticket in self.served[skip:])


def test_two_flows_arriving_ten_to_one_are_served_one_to_one() -> None:
    sim = Sim()
    for _ in range(600):
        for _ in range(10):
            sim.submit("flood")
        sim.submit("light")
        sim.finish_oldest()
    share = sim.share(skip=100)
    assert share["light"] == pytest.approx(share["flood"], rel=0.1)
    assert {type(error) for _, error in sim.refused} == {FlowQueueFull}


def test_weights_three_to_one_give_three_to_one() -> None:
    sim = Sim()
    for _ in range(800):
        for _ in range(4):
            sim.submit("heavy", weight=3.0)
            sim.submit("light", weight=1.0)
        sim.finish_oldest()
    share = sim.share(skip=100)
    assert share["heavy"] / share["light"] == pytest.approx(3.0, rel=0.1)


def test_token_sized_requests_share_by_tokens() -> None:
    sim = Sim()
    for _ in range(800):
        for _ in range(4):
            sim.submit("small", size=100.0)
            sim.submit("large", size=300.0)
        sim.finish_oldest()
    share = sim.share(skip=100)
    # Equal tokens: three small requests for every large one.
    assert share["small"] / share["large"] == pytest.approx(3.0, rel=0.1)


def test_a_flow_is_served_in_arrival_order() -> None:
    sim = Sim()
    tickets = [sim.submit("a", size=float(size)) for size in (5, 1, 9, 2, 7, 3)]
    others = [sim.submit("b") for _ in range(6)]
    for _ in range(20):
        sim.finish_oldest()
    order = [t for t in sim.served if t.flow == "a"]
    assert order == tickets
    assert [t for t in sim.served if t.flow == "b"] == others


def test_a_light_flow_waits_behind_at_most_one_of_the_floods_requests() -> None:
    sim = Sim()
    for _ in range(50):
        sim.submit("flood")
    light = sim.submit("light")
    assert light.outcome is None
    through = len(sim.served)
    for _ in range(5):
        sim.finish_oldest()
    assert light in sim.served[through : through + 2]


def test_the_flow_capacity_refuses_with_flow_queue_full() -> None:
    sim = Sim(flow_capacity=3, total_capacity=10, critical_reserved=0)
    for _ in range(2 + 3):  # two through (bypass limit), three waiting
        sim.submit("a")
    refused = sim.submit("a")
    [(ticket, error)] = sim.refused
    assert ticket is refused
    assert (error.status, error.code, error.retry_after) == (503, "flow_queue_full", 1)
    assert sim.submit("b").outcome is None  # another flow still gets in


def test_the_total_capacity_refuses_with_queue_full() -> None:
    sim = Sim(flow_capacity=2, total_capacity=4, critical_reserved=0)
    for flow in "xxaabb":  # two go through, four wait
        sim.submit(flow)
    assert not sim.refused
    sim.submit("c")
    [(_, error)] = sim.refused
    assert (error.status, error.code) == (503, "queue_full")
    assert sim.controller.waiting == 4


def test_requests_past_the_ttl_expire_with_503() -> None:
    sim = Sim(queue_ttl=10.0)
    sim.submit("a")
    sim.submit("a")
    waiting = sim.submit("a")
    sim.clock.now = 9.9
    assert sim.controller.expire() == pytest.approx(10.0)
    assert waiting.outcome is None
    sim.clock.now = 10.0
    assert sim.controller.expire() is None
    assert waiting.outcome is Outcome.EXPIRED
    error = error_of(waiting)
    assert error is not None
    assert (error.status, error.code) == (503, "queue_ttl_expired")
    assert sim.controller.waiting == 0


def test_a_cancelled_waiter_is_freed_at_once_and_never_dispatched() -> None:
    sim = Sim()
    sim.submit("a")
    sim.submit("a")
    leaving = sim.submit("a")
    staying = sim.submit("a")
    sim.controller.release(leaving)
    assert leaving.outcome is Outcome.CANCELLED
    assert sim.decided == [leaving]  # its waiter woke in the same call
    assert sim.controller.waiting == 1
    sim.finish_oldest()
    sim.finish_oldest()
    assert leaving not in sim.served
    assert staying in sim.served


def test_waiting_past_the_clients_deadline_gives_504() -> None:
    sim = Sim(queue_ttl=30.0)
    sim.submit("a")
    sim.submit("a")
    hurried = sim.submit("a", deadline=2.0)
    patient = sim.submit("a")
    sim.clock.now = 2.0
    assert sim.controller.expire() == pytest.approx(30.0)
    assert hurried.outcome is Outcome.DEADLINE
    assert patient.outcome is None
    error = error_of(hurried)
    assert error is not None
    assert (error.status, error.code, error.retry_after) == (
        504,
        "deadline_exceeded",
        None,
    )


def test_a_deadline_already_past_is_refused_when_it_would_wait() -> None:
    sim = Sim()
    sim.clock.now = 5.0
    assert sim.submit("a", deadline=4.0).outcome is Outcome.BYPASSED
    sim.submit("a")
    sim.submit("a", deadline=4.0)
    [(_, error)] = sim.refused
    assert error.code == "deadline_exceeded"


def _full_queue(**knobs: object) -> FairRequestQueue:
    values: dict[str, object] = {
        "total_capacity": 6,
        "flow_capacity": 6,
        "critical_reserved": 0,
    }
    values.update(knobs)
    return FairRequestQueue(**values)  # type: ignore[arg-type]


def test_preemption_sheds_sheddable_first_then_default_never_critical() -> None:
    queue = _full_queue(total_capacity=4)
    critical = Ticket(flow="c", criticality=Criticality.CRITICAL)
    default = Ticket(flow="d", criticality=Criticality.DEFAULT)
    sheddable = [Ticket(flow="s", criticality=Criticality.SHEDDABLE) for _ in range(2)]
    for ticket in (critical, default, *sheddable):
        queue.push(ticket, 0.0)
    assert queue.push(Ticket(flow="d2"), 1.0) == [sheddable[1]]  # the newest
    assert queue.push(Ticket(flow="c2", criticality=Criticality.CRITICAL), 1.0) == [
        sheddable[0]
    ]
    with pytest.raises(QueueFull):  # default never sheds default
        queue.push(Ticket(flow="d3"), 2.0)
    preempted = queue.push(Ticket(flow="c3", criticality=Criticality.CRITICAL), 2.0)
    assert preempted[0].criticality is Criticality.DEFAULT
    queue.push(Ticket(flow="c4", criticality=Criticality.CRITICAL), 2.0)
    assert {t.criticality for t in queue.waiting()} == {Criticality.CRITICAL}
    with pytest.raises(QueueFull):  # nothing left to shed: critical is kept
        queue.push(Ticket(flow="c5", criticality=Criticality.CRITICAL), 3.0)
    assert critical in list(queue.waiting())


def test_preemption_takes_from_the_least_recently_preempted_flow() -> None:
    queue = _full_queue(total_capacity=6)
    for flow in ("x", "x", "y", "y", "z", "z"):
        queue.push(Ticket(flow=flow, criticality=Criticality.SHEDDABLE), 0.0)
    victims = [
        queue.push(Ticket(flow=f"c{i}", criticality=Criticality.CRITICAL), 1.0)[0].flow
        for i in range(3)
    ]
    assert sorted(victims) == ["x", "y", "z"]  # spread, not all from one flow


def test_critical_requests_have_reserved_places() -> None:
    queue = _full_queue(total_capacity=4, critical_reserved=2)
    queue.push(Ticket(flow="a"), 0.0)
    queue.push(Ticket(flow="b"), 0.0)
    with pytest.raises(QueueFull):
        queue.push(Ticket(flow="c"), 0.0)
    queue.push(Ticket(flow="c", criticality=Criticality.CRITICAL), 0.0)
    assert queue.push(Ticket(flow="d", criticality=Criticality.CRITICAL), 0.0) == []
    assert len(queue) == 4


def test_critical_is_served_before_default_and_sheddable() -> None:
    sim = Sim()
    sim.submit("x")
    sim.submit("x")
    low = sim.submit("s", criticality=Criticality.SHEDDABLE)
    mid = sim.submit("d")
    high = sim.submit("c", criticality=Criticality.CRITICAL)
    for _ in range(5):
        sim.finish_oldest()
    assert sim.served[2:] == [high, mid, low]


def _drain_levels(queue: FairRequestQueue, pops: int) -> Counter[str]:
    served: Counter[str] = Counter()
    for _ in range(pops):
        ticket = queue.pop()
        assert ticket is not None
        served[ticket.criticality.label] += 1
    return served


def _flood(queue: FairRequestQueue, per_level: int) -> None:
    for n in range(per_level):
        for level in Criticality:
            queue.push(Ticket(flow=f"{level.label}{n % 4}", criticality=level), 0.0)


def test_a_critical_flood_leaves_the_other_levels_their_shares() -> None:
    queue = FairRequestQueue(total_capacity=1000, flow_capacity=1000)
    _flood(queue, 300)
    served = _drain_levels(queue, 200)
    assert served == {"critical": 140, "default": 50, "sheddable": 10}


def test_shares_of_100_0_0_serve_the_levels_strictly_in_order() -> None:
    queue = FairRequestQueue(
        total_capacity=1000,
        flow_capacity=1000,
        shares={
            Criticality.CRITICAL: 100,
            Criticality.DEFAULT: 0,
            Criticality.SHEDDABLE: 0,
        },
    )
    _flood(queue, 10)
    order = [ticket.criticality for ticket in iter(queue.pop, None)]
    assert order == sorted(order, reverse=True)  # critical, default, sheddable


def test_a_level_that_starts_waiting_gets_no_credit_for_its_idle_time() -> None:
    queue = FairRequestQueue(total_capacity=1000, flow_capacity=1000)
    for _ in range(100):
        queue.push(Ticket(flow="c", criticality=Criticality.CRITICAL), 0.0)
    assert _drain_levels(queue, 60) == {"critical": 60}
    for _ in range(40):
        queue.push(Ticket(flow="d"), 0.0)
    # The default level now gets its quarter, not 60 requests' worth at once.
    served = _drain_levels(queue, 19)
    assert served["default"] <= 6


def test_the_shares_are_settings_checked_by_name() -> None:
    assert AdmissionSettings().shares[Criticality.SHEDDABLE] == 5
    problems = AdmissionSettings.check(
        critical_share=0, default_share=0, sheddable_share=0
    )
    assert "critical_share" in problems
    assert AdmissionSettings.check(default_share=101) == {
        "default_share": "must be a whole number from 0 to 100, got 101"
    }


def test_a_preempted_waiter_is_told_503_preempted() -> None:
    sim = Sim(total_capacity=1, flow_capacity=1, critical_reserved=0)
    sim.submit("a")
    sim.submit("a")
    shed = sim.submit("s", criticality=Criticality.SHEDDABLE)
    sim.submit("c", criticality=Criticality.CRITICAL)
    assert shed.outcome is Outcome.PREEMPTED
    error = error_of(shed)
    assert error is not None
    assert (error.status, error.code) == (503, "preempted")


def test_steady_overload_switches_to_queueing_once_without_oscillating() -> None:
    sim = Sim(ready=4, watermark_per_backend=2, percentage_deviation_for_bounds=0.25)
    pool_changes = []
    for tick in range(400):
        sim.submit(f"t{tick % 3}")
        sim.submit(f"t{tick % 5}")
        sim.finish_oldest()
        pool = sim.controller.pools["pool"]
        pool_changes.append(pool.mode_changes)
        assert pool.stock <= pool.band.bypass_limit
    assert pool_changes[-1] == 1  # into queueing once, never back while loaded
    # The load stops: the queue drains and the pool goes back to bypass, once.
    while sim.in_flight:
        sim.finish_oldest()
    assert sim.controller.pools["pool"].mode_changes == 2


def test_bands_scale_with_ready_backends_and_split_between_processes() -> None:
    settings_ = AdmissionSettings(
        watermark_per_backend=4, percentage_deviation_for_bounds=0.1
    )
    whole = settings_.band(2)
    assert (whole.lower, whole.upper) == pytest.approx((7.2, 8.8))
    assert (whole.dispatch_limit, whole.bypass_limit) == (8, 9)
    shares = [settings_.band(2, index, 3) for index in range(3)]
    assert sum(b.dispatch_limit for b in shares) == 8
    assert sum(b.bypass_limit for b in shares) == 9
    assert min(settings_.band(1, i, 16).dispatch_limit for i in range(16)) == 1


def test_settings_name_the_fields_they_refuse() -> None:
    both = "lower_bound_per_backend .5. .*above upper_bound_per_backend .3."
    with pytest.raises(ValueError, match=both):
        AdmissionSettings(lower_bound_per_backend=5, upper_bound_per_backend=3)
    with pytest.raises(ValueError, match="queue_ttl: must be more than 0"):
        AdmissionSettings(queue_ttl=0)
    with pytest.raises(ValueError, match="percentage_deviation_for_bounds"):
        AdmissionSettings(percentage_deviation_for_bounds=1)
    with pytest.raises(ValueError, match="flow_capacity: cannot exceed"):
        AdmissionSettings(total_capacity=10, flow_capacity=20, critical_reserved=0)


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["submit", "finish", "cancel", "tick", "expire"]),
        st.integers(0, 3),  # flow
        st.sampled_from(list(Criticality)),
        st.floats(0.5, 50.0),  # size
        st.one_of(st.none(), st.floats(0.0, 20.0)),  # deadline offset
    ),
    max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, ready=st.integers(1, 3), capacity=st.integers(1, 8))
def test_every_arrival_is_accounted_for_and_the_stock_returns_to_zero(
    ops: list[tuple[str, int, Criticality, float, float | None]],
    ready: int,
    capacity: int,
) -> None:
    sim = Sim(
        ready=ready,
        total_capacity=capacity,
        flow_capacity=max(1, capacity // 2),
        critical_reserved=capacity // 4,
        queue_ttl=5.0,
    )
    controller = sim.controller
    submitted: list[Ticket] = []
    for op, flow, criticality, size, deadline in ops:
        if op == "submit":
            submitted.append(
                sim.submit(
                    f"f{flow}",
                    criticality=criticality,
                    size=size,
                    deadline=None if deadline is None else sim.clock.now + deadline,
                )
            )
        elif op == "finish":
            sim.finish_oldest()
        elif op == "cancel" and submitted:
            controller.release(submitted[flow % len(submitted)])
        elif op == "tick":
            sim.clock.now += size / 10
        else:
            controller.expire()
        assert all(pool.stock >= 0 for pool in controller.pools.values())
        for pool in controller.pools.values():
            assert pool.stock <= pool.band.bypass_limit
            assert len(pool.queue) <= capacity
    # Come to rest: every client that is still around finishes or gives up.
    for ticket in submitted:
        controller.release(ticket)
    counts = controller.counts
    assert controller.stock == 0 and controller.waiting == 0
    went_through = counts.bypassed + counts.dispatched
    assert (
        went_through
        + counts.expired
        + counts.deadline
        + counts.cancelled
        + counts.preempted
        + counts.rejected
        == counts.arrived
        == len(submitted)
    )
    assert went_through == sum(t.outcome in GO for t in submitted)


def test_the_default_band_lets_an_idle_backend_run_a_few_at_once() -> None:
    # No max_concurrency: 4 per backend ± 10 %, 5 straight through per backend.
    band = AdmissionSettings().band(1)
    assert (band.dispatch_limit, band.bypass_limit) == (4, 5)
    assert AdmissionSettings().band(3).bypass_limit == 14


def test_a_backend_with_max_concurrency_gets_exactly_its_slots() -> None:
    settings_ = AdmissionSettings(watermark_per_backend=2)
    # One backend says 8, one says nothing (2 ± 10 %): 8 + 2.2 -> 11 through.
    band = settings_.band(2, capacities=(8,))
    assert (band.lower, band.upper, band.watermark) == pytest.approx((9.8, 10.2, 10))
    assert (band.dispatch_limit, band.bypass_limit) == (10, 11)
    # Every slot is used, never more: the router would refuse the next one.
    only = settings_.band(2, capacities=(8, 1))
    assert (only.dispatch_limit, only.bypass_limit) == (9, 9)
    halves = [settings_.band(2, index, 2, capacities=(8, 1)) for index in range(2)]
    assert sum(b.bypass_limit for b in halves) == 9


def test_an_idle_pool_of_max_concurrency_backends_never_queues() -> None:
    sim = Sim(ready=1)
    tickets = [Ticket(flow=f"t{n}") for n in range(9)]
    for ticket in tickets:
        sim.controller.admit(ticket, "pool", 1, (8,))
    outcomes = [ticket.outcome for ticket in tickets]
    assert outcomes[:8] == [Outcome.BYPASSED] * 8
    assert outcomes[8] is None  # the ninth waits for a free slot


def test_waiting_requests_go_first_to_a_backend_that_turns_ready() -> None:
    # Issue 30's reproduction: one backend running 3 at once, 3 in flight and
    # 3 waiting; a second backend turns ready.
    controller = AdmissionController(AdmissionSettings(), clock=Clock())
    older = [Ticket(flow="a") for _ in range(6)]
    for ticket in older:
        controller.admit(ticket, "m", 1, (3,), ("gpu-1",))
    assert [t.outcome for t in older].count(None) == 3
    controller.resize("m", 2, (3, 3), ("gpu-1", "gpu-2"))
    # The waiting three go at once, before anything new arrives...
    assert all(t.outcome in GO for t in older)
    assert controller.pools["m"].backends == ("gpu-1", "gpu-2")
    # ... and newcomers wait for the band instead of overtaking them.
    newer = [Ticket(flow="b") for _ in range(4)]
    for ticket in newer:
        controller.admit(ticket, "m", 2, (3, 3), ("gpu-1", "gpu-2"))
    assert [t.outcome for t in newer] == [None] * 4
    assert controller.pools["m"].stock == 6


def test_waiting_requests_of_a_model_left_without_backends_go_on() -> None:
    controller = AdmissionController(AdmissionSettings(), clock=Clock())
    tickets = [Ticket(flow="a") for _ in range(3)]
    for ticket in tickets:
        controller.admit(ticket, "m", 1, (1,))
    assert tickets[2].outcome is None
    controller.open_pool("m")  # to the router: a fallback, or its error
    assert all(t.outcome in GO for t in tickets)
    for ticket in tickets:
        controller.release(ticket)
    assert controller.stock == 0


def _let_through(settings_: AdmissionSettings, size: float, count: int) -> int:
    controller = AdmissionController(settings_, clock=Clock())
    tickets = [Ticket(flow=f"t{n}", size=size) for n in range(count)]
    for ticket in tickets:
        controller.admit(ticket, "m", 1)
    return sum(ticket.outcome in GO for ticket in tickets)


def test_in_tokens_ten_large_prompts_hold_the_band_ten_small_ones_do_not() -> None:
    # One backend: 4 requests ± 10 % in requests; in tokens 4 x 512 = 2,048
    # (the default size of a request is twice default_output_tokens, 256).
    requests = AdmissionSettings()
    tokens = AdmissionSettings(stock_unit=StockUnit.TOKENS)
    assert tokens.band(1).watermark == 2048
    assert (_let_through(requests, 100, 10), _let_through(requests, 4000, 10)) == (
        5,
        5,
    )
    # Ten 100-token requests fit; of ten 1,000-token ones, three are in
    # flight (0, 1,000 and 2,000 are below the 2,253 bound) and seven wait.
    assert _let_through(tokens, 100, 10) == 10
    assert _let_through(tokens, 1000, 10) == 3
    # One request larger than the whole band still goes when nothing is in
    # flight, or it could never be served.
    assert _let_through(tokens, 50_000, 2) == 1


def test_in_tokens_the_stock_returns_to_zero_and_frees_the_band() -> None:
    controller = AdmissionController(
        AdmissionSettings(
            stock_unit=StockUnit.TOKENS, watermark_tokens_per_backend=1000
        ),
        clock=Clock(),
    )
    big = [Ticket(flow="a", size=600) for _ in range(3)]
    for ticket in big:
        controller.admit(ticket, "m", 1)
    assert [t.outcome in GO for t in big] == [True, True, False]
    controller.release(big[0])
    assert big[2].outcome is Outcome.DISPATCHED  # 600 left, below the 900 bound
    for ticket in big[1:]:
        controller.release(ticket)
    pool = controller.pools["m"]
    assert (pool.stock, pool.stock_tokens) == (0, 0.0)


def test_in_tokens_max_concurrency_backends_keep_their_request_limit() -> None:
    settings_ = AdmissionSettings(stock_unit=StockUnit.TOKENS)
    band = settings_.band(2, capacities=(2, 2))
    assert (band.dispatch_limit, band.bypass_limit) == (4, 4)
    assert band.token_bypass_limit == 4 * 512
    assert settings_.band(2, capacities=(2,)).bypass_limit > 10**9  # one says none
    assert AdmissionSettings.check(watermark_tokens_per_backend=0) == {
        "watermark_tokens_per_backend": "must be more than 0 and at most 1e+08, got 0"
    }


def test_output_size_per_model_replaces_the_default() -> None:
    settings_ = AdmissionSettings(
        default_output_tokens=100, model_output_tokens={"big": 2000}
    )
    assert settings_.size_of(10, None, "big") == 2010
    assert settings_.size_of(10, None, "alias", "big") == 2010  # its alias target
    assert settings_.size_of(10, None, "small") == 110
    assert settings_.size_of(10, 5, "big") == 15  # max_tokens wins
    assert AdmissionSettings.check(model_output_tokens={"big": -1}) == {
        "model_output_tokens": "the output tokens of 'big' must be a whole number "
        "from 0 to 10000000, got -1"
    }
