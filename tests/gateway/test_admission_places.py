"""Admission's queue places: total_capacity and flow_capacity for the gateway.

The real ``AdmissionGate`` over two models' pools; the places counted in this
process (``LocalPlaces``), or in Redis by two gates standing for two serving
processes (``SharedPlaces`` over two ``RedisLimiter``s, production mode).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis
from django.conf import settings

from gateway.admission import AdmissionGate
from gateway.admission_places import LocalPlaces, Places, SharedPlaces
from routing.admission import (
    AdmissionSettings,
    Criticality,
    FlowQueueFull,
    Preempted,
    QueueFull,
    Ticket,
)
from usage.limits.redis_limiter import RedisLimiter

SETTINGS = AdmissionSettings(total_capacity=3, flow_capacity=2, critical_reserved=1)


def _ticket(flow: str, model: str, level: Criticality = Criticality.DEFAULT) -> Ticket:
    # One ready backend running one request at a time: a band of exactly 1.
    return Ticket(
        flow=flow,
        criticality=level,
        model=model,
        pool_key=model,
        ready=1,
        capacities=(1,),
        backends=(model,),
    )


def _gate(places: Places) -> AdmissionGate:
    gate = AdmissionGate(places=places)
    gate.controller.configure(SETTINGS)
    return gate


async def _settle() -> None:
    for _ in range(5):  # let the awaiting admits run up to their waits
        await asyncio.sleep(0)


class Waiters:
    """Admissions under way: each one's gate, ticket and task."""

    def __init__(self) -> None:
        self.tasks: dict[str, tuple[AdmissionGate, Ticket, asyncio.Task[None]]] = {}
        self.released: set[str] = set()

    async def admit(self, name: str, gate: AdmissionGate, ticket: Ticket) -> None:
        """Start an admission; return once it waits in a queue or is decided
        (with Redis, after its round trip)."""
        task = asyncio.create_task(gate.admit(ticket))
        self.tasks[name] = (gate, ticket, task)
        async with asyncio.timeout(10):
            while not (task.done() or ticket.queued):
                await asyncio.sleep(0.001)
        await _settle()

    def error(self, name: str) -> BaseException | None:
        task = self.tasks[name][2]
        return task.exception() if task.done() else None

    def waiting(self) -> list[str]:
        return sorted(
            name for name, (_, _, task) in self.tasks.items() if not task.done()
        )

    async def end(self, name: str) -> None:
        """The request is over: let through and answered, or its client left."""
        gate, ticket, _ = self.tasks[name]
        gate.release(ticket)
        self.released.add(name)
        await _settle()

    async def end_all(self) -> None:
        """End every request let through, until nothing waits."""
        while True:
            going = [
                name
                for name, (_, _, task) in self.tasks.items()
                if name not in self.released and task.done() and not task.exception()
            ]
            if not going:
                break
            for name in going:
                await self.end(name)


async def _scenario(one: AdmissionGate, two: AdmissionGate) -> None:
    """Two models, their backends busy; 3 places in the gateway, 1 of them
    kept for critical requests, 2 per flow."""
    waiters = Waiters()
    await waiters.admit("m busy", one, _ticket("a", "m"))
    await waiters.admit("n busy", two, _ticket("a", "n"))
    assert waiters.waiting() == []  # both went straight through

    # Flow "f" waits for m in one process and n in the other: its 2 places.
    await waiters.admit("f-m", one, _ticket("f", "m"))
    await waiters.admit("f-n", two, _ticket("f", "n"))
    await waiters.admit("f-m2", one, _ticket("f", "m", Criticality.CRITICAL))
    assert isinstance(waiters.error("f-m2"), FlowQueueFull)
    # Their clients leave: their places are free again.
    await waiters.end("f-m")
    await waiters.end("f-n")
    assert waiters.waiting() == []

    await waiters.admit("a-m", one, _ticket("a", "m"))
    await waiters.admit("b-n", two, _ticket("b", "n"))
    assert waiters.waiting() == ["a-m", "b-n"]
    # Room in the gateway and in flow "c", but not for a non-critical request
    # (the reserved place), and nothing less critical to shed:
    await waiters.admit("c-m", one, _ticket("c", "m"))
    assert isinstance(waiters.error("c-m"), QueueFull)
    assert "1 places of them kept for critical ones" in str(waiters.error("c-m"))
    await waiters.admit("c-n", two, _ticket("c", "n", Criticality.CRITICAL))
    assert waiters.waiting() == ["a-m", "b-n", "c-n"]
    # Full: a critical arrival sheds a less critical request waiting in its
    # own process.
    await waiters.admit("d-m", one, _ticket("d", "m", Criticality.CRITICAL))
    assert isinstance(waiters.error("a-m"), Preempted)
    assert waiters.waiting() == ["b-n", "c-n", "d-m"]
    # Full, and nothing less critical waits: refused.
    await waiters.admit("e-m", one, _ticket("e", "m", Criticality.SHEDDABLE))
    assert isinstance(waiters.error("e-m"), QueueFull)
    # Critical flows' guaranteed capacity: a critical request is refused only
    # when 3 critical ones wait. One more sheds the default request (in one
    # process), or, where its process has nothing to shed, waits over the
    # total (two processes), and the next sheds it from the other process;
    # then 3 critical ones wait and the next critical one is refused.
    await waiters.admit("g-m", one, _ticket("g", "m", Criticality.CRITICAL))
    await waiters.admit("h-n", two, _ticket("h", "n", Criticality.CRITICAL))
    assert isinstance(waiters.error("b-n"), Preempted)
    assert isinstance(waiters.error("h-n"), QueueFull)
    assert "3 critical requests wait" in str(waiters.error("h-n"))
    assert waiters.waiting() == ["c-n", "d-m", "g-m"]

    # The busy ones end, then the ones they let through: every place and
    # every stock is given back.
    await waiters.end("m busy")
    await waiters.end("n busy")
    await waiters.end_all()
    assert waiters.waiting() == []
    for gate in (one, two):
        assert gate.controller.waiting == 0
        assert gate.controller.stock == 0
    for name, (_, ticket, _) in waiters.tasks.items():
        assert ticket.held is None, name
    # What the dashboard shows: each refusal once, by its reason.
    refusals: Counter[str] = Counter()
    for gate in {id(one): one, id(two): two}.values():
        refusals.update(gate.snapshot()["rejections"])
    assert refusals == {
        "flow_queue_full": 1,
        "queue_full": 3,
        "preempted": 2,
        "client_closed": 2,
    }


@pytest.mark.mode_independent
def test_one_process_counts_places_over_every_model() -> None:
    places = LocalPlaces()
    gate = _gate(places)

    asyncio.run(_scenario(gate, gate))

    assert places.counts == {}  # every count back to 0


@pytest.fixture
def redis_url() -> Iterator[str]:
    if not settings.REDIS_URL:
        pytest.skip("the embedded suite's servers have no Redis")
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter("nx:{admission}:*"):
        client.delete(key)
    yield settings.REDIS_URL
    # Nothing left for the next test's gateway (a dead process's places
    # would count for 60 s).
    for key in client.scan_iter("nx:{admission}:*"):
        client.delete(key)
    client.close()


def _run_with(
    limiters: list[RedisLimiter], main: Callable[[], Awaitable[None]]
) -> None:
    async def run() -> None:
        for limiter in limiters:
            limiter.start()
        try:
            await main()
        finally:
            for limiter in limiters:
                await limiter.stop()

    asyncio.run(run())


def test_two_processes_share_the_places_in_redis(redis_url: str) -> None:
    limiters = [RedisLimiter(redis_url), RedisLimiter(redis_url)]
    gates = [_gate(SharedPlaces(limiter)) for limiter in limiters]

    _run_with(limiters, lambda: _scenario(*gates))

    client = redis.Redis.from_url(redis_url)
    left = {key: client.zcard(key) for key in client.scan_iter("nx:{admission}:*")}
    client.close()
    assert not any(left.values()), left


def test_places_of_a_process_that_died_expire(redis_url: str) -> None:
    first = RedisLimiter(redis_url)

    async def hold_one() -> None:
        places = SharedPlaces(first)
        held = await places.take("a", False, SETTINGS)
        assert not isinstance(held, str)
        # The process dies: nothing is given back, nothing renewed.
        first._leases.clear()

    _run_with([first], hold_one)
    client = redis.Redis.from_url(redis_url)
    waiting = client.zrange("nx:{admission}:waiting:total", 0, -1, withscores=True)
    client.close()
    assert len(waiting) == 1
    (_, expires), now = waiting[0], client.time()
    assert 55_000 < expires - (now[0] * 1000 + now[1] / 1000) <= 60_000
