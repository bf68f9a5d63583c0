"""The fleet scheduler of one process: slots, lines, moves, warm-ups and holds.

In process, with real live stats and metrics; the warm-up goes to a real mock
Ollama process, which counts the loads it performs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import pytest

from gateway.fleet.errors import QueueFull, QueueTimeout
from gateway.fleet.scheduler import FleetScheduler, Placement
from gateway.metrics import GatewayMetrics
from routing.core import LiveStats, RequestRequirements, Route, Router, RouterSnapshot
from routing.core.fleet_policy import FleetPolicy
from routing.core.policy import Policy
from routing.core.types import BackendSpec, ModelSpec, Target
from routing.core.vocabulary import Strategy
from tests.conftest import MockBackendProcess

pytestmark = pytest.mark.mode_independent


def _routes(*backends: BackendSpec, **fleet: Any) -> RouterSnapshot:
    strategy = Strategy(fleet.pop("strategy", "fleet"))
    policy = Policy(strategy=strategy, fleet=FleetPolicy(**fleet))
    return RouterSnapshot.build(backends=backends, policy=policy)


def _backend(
    name: str,
    *,
    capacity: int = 1,
    loaded: bool = True,
    model_limit: int | None = None,
    kind: str = "ollama",
    url: str = "http://127.0.0.1:9",
    size_gb: float | None = None,
) -> BackendSpec:
    limit = {} if model_limit is None else {"max_concurrency": model_limit}
    model = ModelSpec("m", loaded=loaded, size_gb=size_gb, **limit)
    return BackendSpec(
        name,
        url,
        kind=kind,
        status="healthy",
        max_concurrency=capacity,
        models=(model,),
    )


def _route(routes: RouterSnapshot, backend: str, *others: str) -> Route:
    def target(name: str) -> Target:
        spec = routes.backend(name)
        assert spec is not None
        return Target(spec, spec.models[0])

    decision = SimpleNamespace(
        retry_targets=tuple(target(o) for o in others),
        retry_order=tuple(target(o) for o in others),
    )
    return Route(target(backend), decision)  # type: ignore[arg-type]


class Harness:
    """A scheduler over a snapshot that tests may swap."""

    def __init__(self, routes: RouterSnapshot) -> None:
        self.routes: RouterSnapshot | None = routes
        self.stats = LiveStats()
        self.session: aiohttp.ClientSession | None = None
        self.fleet = FleetScheduler(
            self.stats,
            GatewayMetrics(),
            session=lambda: self._session(),
            routes=lambda: self.routes,
        )

    def _session(self) -> aiohttp.ClientSession:
        assert self.session is not None
        return self.session

    def begin(self, route: Route | Placement) -> None:
        assert self.stats.try_begin(route.target.backend, route.target.model.name)

    def end(self, backend: str) -> None:
        self.stats.end(backend, "m")
        self.fleet.finished(backend)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_free_slot_is_taken_at_once_and_a_full_one_is_waited_for() -> None:
    routes = _routes(_backend("a", capacity=1))
    h = Harness(routes)
    route = _route(routes, "a")
    assert await h.fleet.take_slot(route, routes) is route
    h.begin(route)
    waiting = [asyncio.create_task(h.fleet.take_slot(route, routes)) for _ in range(2)]
    await _settle()
    assert not any(task.done() for task in waiting)
    assert h.fleet.queues.waiting("a", "m") == 2
    h.end("a")
    await _settle()
    assert waiting[0].done() and not waiting[1].done()  # first come, first served
    h.begin(waiting[0].result())
    h.end("a")
    await _settle()
    assert waiting[1].done()
    assert h.fleet.queues.waiting("a", "m") == 0


async def test_strategies_other_than_fleet_never_wait() -> None:
    routes = _routes(_backend("a", capacity=1), strategy="smart")
    h = Harness(routes)
    route = _route(routes, "a")
    h.begin(route)
    assert await h.fleet.take_slot(route, routes) is route


async def test_a_full_line_refuses_and_a_long_wait_times_out() -> None:
    routes = _routes(
        _backend("a", capacity=1),
        fleet_queue_length=1,
        fleet_queue_timeout_seconds=0.2,
    )
    h = Harness(routes)
    route = _route(routes, "a")
    h.begin(route)
    first = asyncio.create_task(h.fleet.take_slot(route, routes))
    await _settle()
    with pytest.raises(QueueFull) as full:
        await h.fleet.take_slot(route, routes)
    assert full.value.code == "queue_full"
    with pytest.raises(QueueTimeout) as late:
        await first
    assert late.value.retry_after >= 1
    assert h.fleet.queues.waiting("a", "m") == 0


async def test_a_waiter_that_leaves_frees_its_place_and_its_slot_goes_on() -> None:
    routes = _routes(_backend("a", capacity=1))
    h = Harness(routes)
    route = _route(routes, "a")
    h.begin(route)
    gone = asyncio.create_task(h.fleet.take_slot(route, routes))
    stays = asyncio.create_task(h.fleet.take_slot(route, routes))
    await _settle()
    gone.cancel()
    await _settle()
    assert h.fleet.queues.waiting("a", "m") == 1
    h.end("a")
    await _settle()
    assert stays.done()
    assert h.fleet.queues.reserved("a") == 0


async def test_a_slot_granted_to_a_waiter_that_left_passes_to_the_next() -> None:
    routes = _routes(_backend("a", capacity=1))
    h = Harness(routes)
    route = _route(routes, "a")
    h.begin(route)
    gone = asyncio.create_task(h.fleet.take_slot(route, routes))
    stays = asyncio.create_task(h.fleet.take_slot(route, routes))
    await _settle()
    h.end("a")  # the slot goes to `gone`, which leaves before running
    gone.cancel()
    await _settle()
    assert stays.done()
    assert h.fleet.queues.reserved("a") == 0


async def test_a_gateway_wide_lease_passes_to_the_waiter_that_gets_the_slot() -> None:
    routes = _routes(_backend("a", capacity=1))
    h = Harness(routes)
    released: list[tuple[str, str]] = []
    h.fleet._release_lease = lambda backend, lease: released.append((backend, lease))
    route = _route(routes, "a")
    assert not h.fleet.finished("a", "lease-0")  # nobody waits: the caller releases
    h.begin(route)
    gone = asyncio.create_task(h.fleet.take_slot(route, routes))
    stays = asyncio.create_task(h.fleet.take_slot(route, routes))
    await _settle()
    h.stats.end("a", "m")
    assert h.fleet.finished("a", "lease-1")  # handed over, not released
    gone.cancel()  # it had the slot and the lease: both go to the next waiter
    await _settle()
    placed = stays.result()
    assert isinstance(placed, Placement)
    assert placed.lease == "lease-1"
    assert placed.target.backend.name == "a"
    assert released == []


async def test_a_lease_nobody_can_take_is_released() -> None:
    routes = _routes(_backend("a", capacity=1))
    h = Harness(routes)
    released: list[tuple[str, str]] = []
    h.fleet._release_lease = lambda backend, lease: released.append((backend, lease))
    route = _route(routes, "a")
    h.begin(route)
    gone = asyncio.create_task(h.fleet.take_slot(route, routes))
    await _settle()
    h.stats.end("a", "m")
    assert h.fleet.finished("a", "lease-1")
    gone.cancel()
    await _settle()
    assert released == [("a", "lease-1")]
    assert h.fleet.queues.reserved("a") == 0


async def test_the_model_limit_holds_even_with_room_on_the_backend() -> None:
    routes = _routes(_backend("a", capacity=5, model_limit=1))
    h = Harness(routes)
    route = _route(routes, "a")
    assert await h.fleet.take_slot(route, routes) is route
    h.begin(route)
    second = asyncio.create_task(h.fleet.take_slot(route, routes))
    await _settle()
    assert not second.done()
    h.end("a")
    await _settle()
    assert second.done()


async def test_rebalance_moves_at_most_the_cap_and_only_to_hot_backends() -> None:
    routes = _routes(
        _backend("busy", capacity=1),
        _backend("hot", capacity=10),
        _backend("cold", capacity=10, loaded=False),
        rebalance_threshold=2,
        rebalance_max_moves=2,
    )
    h = Harness(routes)
    route = _route(routes, "busy", "hot", "cold")
    h.begin(route)
    waiters = [asyncio.create_task(h.fleet.take_slot(route, routes)) for _ in range(5)]
    await _settle()
    moves = h.fleet.rebalance(routes)
    await _settle()
    assert [(m.source, m.destination) for m in moves] == [("busy", "hot")] * 2
    moved = [task.result() for task in waiters if task.done()]
    assert len(moved) == 2
    assert all(isinstance(p, Placement) for p in moved)
    assert {p.target.backend.name for p in moved} == {"hot"}
    # The moved requests retry elsewhere, never on their new backend again.
    assert all("hot" not in [t.backend.name for t in p.retry_targets] for p in moved)
    # The oldest moved; the rest still wait for "busy". The next cycle moves
    # two more (depth 1 + 3 waiting = 4 > 2); then the line is at the threshold.
    assert h.fleet.queues.waiting("busy", "m") == 3
    assert len(h.fleet.rebalance(routes)) == 2
    assert h.fleet.rebalance(routes) == []
    assert h.fleet.queues.waiting("busy", "m") == 1
    for task in waiters:
        task.cancel()


async def test_rebalance_never_moves_to_a_backend_where_the_model_is_cold() -> None:
    routes = _routes(
        _backend("busy", capacity=1),
        _backend("cold", capacity=10, loaded=False),
        rebalance_threshold=1,
    )
    h = Harness(routes)
    route = _route(routes, "busy", "cold")
    h.begin(route)
    waiters = [asyncio.create_task(h.fleet.take_slot(route, routes)) for _ in range(4)]
    await _settle()
    assert h.fleet.rebalance(routes) == []
    assert not any(task.done() for task in waiters)
    for task in waiters:
        task.cancel()


@pytest.mark.parametrize("down", ["circuit_open", "error_cached"])
async def test_rebalance_never_moves_to_a_backend_routing_skips(down: str) -> None:
    routes = _routes(
        _backend("busy", capacity=1),
        _backend("hot", capacity=10),
        rebalance_threshold=1,
    )
    h = Harness(routes)
    if down == "circuit_open":
        h.stats.open_circuit("hot", h.stats.clock() + 60)
    else:  # a connection to it just failed (the error cache)
        h.stats.fail_connection("hot", h.stats.clock() + 60)
    route = _route(routes, "busy", "hot")
    h.begin(route)
    waiters = [asyncio.create_task(h.fleet.take_slot(route, routes)) for _ in range(4)]
    await _settle()
    assert h.fleet.rebalance(routes) == []
    for task in waiters:
        task.cancel()


async def test_a_held_request_wakes_when_a_snapshot_is_installed() -> None:
    routes = _routes(_backend("a"), hold_seconds=30)
    h = Harness(routes)
    h.fleet.start()
    try:
        found: list[RouterSnapshot] = []

        def route_primary(now: RouterSnapshot) -> str | None:
            found.append(now)
            return "served" if len(found) > 1 else None

        held = asyncio.create_task(h.fleet.hold(route_primary))
        await _settle()
        assert h.fleet.held == 1
        h.fleet.snapshot_installed()
        await _settle()
        assert not held.done()  # the first snapshot still had nothing
        h.fleet.snapshot_installed()
        assert await asyncio.wait_for(held, 5) == "served"
        assert h.fleet.held == 0
    finally:
        await h.fleet.stop()


async def test_a_held_request_gives_up_after_hold_seconds() -> None:
    routes = _routes(_backend("a"), hold_seconds=0.2)
    h = Harness(routes)
    h.fleet.start()
    try:
        assert await h.fleet.hold(lambda now: None) is None
        assert h.fleet.held == 0
    finally:
        await h.fleet.stop()


@pytest.fixture
def ollama_node(
    mock_backend_factory: Callable[..., MockBackendProcess],
) -> MockBackendProcess:
    return mock_backend_factory(
        "--kind",
        "ollama",
        "--name",
        "runner-up",
        "--model",
        "m:4",
        "--memory-gb",
        "8",
        "--load-seconds",
        "0.3",
        "--loaded-models",
        "",
    )


async def test_prewarm_loads_the_model_on_the_runner_up_exactly_once(
    ollama_node: MockBackendProcess,
) -> None:
    routes = _routes(
        _backend("winner", capacity=10),
        _backend(
            "runner-up",
            capacity=10,
            loaded=False,
            url=ollama_node.base_url,
            size_gb=4.0,
        ),
        pre_warm_threshold=3,
    )
    h = Harness(routes)
    h.fleet.start()
    h.session = aiohttp.ClientSession()
    try:
        route = _route(routes, "winner", "runner-up")
        for _ in range(8):  # depth 1, 2, ... 8 counting the request routed
            h.fleet.after_decision(route, routes)
            h.begin(route)
            await _settle()
        for _ in range(100):
            if not h.fleet.prewarm.is_running("runner-up", "m"):
                break
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient() as client:
            stats = (await client.get(f"{ollama_node.base_url}/_mock/stats")).json()
            ps = (await client.get(f"{ollama_node.base_url}/api/ps")).json()
        assert stats["loads"] == {"m": 1}
        assert stats["requests"] == {"/api/generate": 1}
        # The warm-up timed the load: 4 GB in 0.3 s or more.
        rate = h.stats.load_gbps("runner-up")
        assert rate is not None and 0 < rate <= 4 / 0.3
        assert [entry["name"] for entry in ps["models"]] == ["m"]
        text = h.fleet.metrics.render().decode()
        assert (
            'nexus_fleet_prewarm_total{backend="runner-up",model="m",'
            'outcome="loaded"} 1.0' in text
        )
    finally:
        await h.session.close()
        await h.fleet.stop()


async def test_a_warm_up_that_fails_for_memory_is_noted_and_never_repeated_there(
    ollama_node: MockBackendProcess,
) -> None:
    async with httpx.AsyncClient() as client:
        # Another client's 6 GB model fills the node: the load cannot fit.
        await client.post(
            f"{ollama_node.base_url}/_mock/config",
            json={"resident_models": {"other": 6.0}, "oom_loads": "estimate"},
        )
    runner_up = _backend(
        "runner-up", capacity=10, loaded=False, url=ollama_node.base_url, size_gb=4.0
    )
    routes = _routes(_backend("winner", capacity=10), runner_up, pre_warm_threshold=3)
    h = Harness(routes)
    h.fleet.start()
    h.session = aiohttp.ClientSession()
    try:
        route = _route(routes, "winner", "runner-up")
        for _ in range(4):
            h.fleet.after_decision(route, routes)
            h.begin(route)
            await _settle()
        for _ in range(100):
            if not h.fleet.prewarm.is_running("runner-up", "m"):
                break
            await asyncio.sleep(0.05)
        failures = h.stats.oom_failures("runner-up")
        assert failures is not None and len(failures.times) == 1
        assert "requires more system memory (3.7 GiB)" in failures.detail
        assert h.stats.load_gbps("runner-up") is None  # no load was timed
        # A second failure pauses cold loads there: no warm-up is tried (a
        # failed one is not remembered, so without the pause it would be).
        h.stats.note_oom("runner-up", "m", failures.detail)
        for _ in range(4):
            h.fleet.after_decision(route, routes)
            h.begin(route)
        await _settle()
        assert not h.fleet.prewarm.is_running("runner-up", "m")
        async with httpx.AsyncClient() as client:
            stats = (await client.get(f"{ollama_node.base_url}/_mock/stats")).json()
        assert stats["requests"] == {"/api/generate": 1}
    finally:
        await h.session.close()
        await h.fleet.stop()


async def test_prewarm_does_nothing_below_the_threshold_or_for_other_kinds(
    ollama_node: MockBackendProcess,
) -> None:
    routes = _routes(
        _backend("winner", capacity=10),
        _backend("vllm", capacity=10, loaded=False, kind="vllm"),
        _backend("runner-up", capacity=10, loaded=False, url=ollama_node.base_url),
        pre_warm_threshold=3,
    )
    h = Harness(routes)
    h.fleet.start()
    try:
        low = _route(routes, "winner", "runner-up")
        h.fleet.after_decision(low, routes)  # depth 1
        other_kind = _route(routes, "winner", "vllm")
        for _ in range(5):
            h.begin(other_kind)
        h.fleet.after_decision(other_kind, routes)  # deep, but not Ollama
        assert not h.fleet.prewarm.is_running("runner-up", "m")
        assert not h.fleet.prewarm.is_running("vllm", "m")
    finally:
        await h.fleet.stop()
    async with httpx.AsyncClient() as client:
        stats = (await client.get(f"{ollama_node.base_url}/_mock/stats")).json()
    assert stats.get("loads_total") == 0


def _node(name: str, ceiling: float, *models: ModelSpec) -> BackendSpec:
    return BackendSpec(
        name,
        "http://127.0.0.1:9",
        kind="ollama",
        status="healthy",
        max_concurrency=2,
        memory_ceiling_gb=ceiling,
        models=models,
    )


def _decide(routes: RouterSnapshot, stats: LiveStats, model: str) -> str:
    found = Router().select(RequestRequirements(model=model), routes, stats)
    return found.target.backend.name


async def test_a_model_sent_to_a_node_is_hot_there_for_the_next_request() -> None:
    # Both nodes have it on disk; the first request's node loads it. The
    # second request must follow it (hot there: +50), not load it elsewhere.
    spec = ModelSpec("m", size_gb=2.0)
    routes = _routes(_node("a", 7.0, spec), _node("b", 7.0, spec))
    h = Harness(routes)
    first = Router().select(RequestRequirements(model="m"), routes, h.stats)
    h.fleet.after_decision(first, routes)
    h.begin(first)

    assert _decide(routes, h.stats, "m") == first.target.backend.name


async def test_a_cold_model_sent_to_a_full_node_unloads_the_oldest_idle_one() -> None:
    # 7 GB node with x (3 GB, used long ago) and y (3 GB, used just now)
    # loaded and idle; z (3 GB) sent there makes it unload x, as Ollama does.
    x = ModelSpec("x", size_gb=3.0, loaded=True)
    y = ModelSpec("y", size_gb=3.0, loaded=True)
    z = ModelSpec("z", size_gb=3.0)
    routes = _routes(_node("a", 7.0, x, y, z))
    h = Harness(routes)
    spec = routes.backend("a")
    assert spec is not None
    h.stats.mark_hot("a", "y")
    h.fleet.note_sent(Target(spec, z), routes)

    assert not h.fleet.is_hot(Target(spec, x), routes)
    assert h.fleet.is_hot(Target(spec, y), routes)
    assert h.fleet.is_hot(Target(spec, z), routes)
    # Its memory is free again for the next decision: x fits beside y and z
    # only by unloading one of them (no fit points), and is not eliminated.
    decision = Router().explain(RequestRequirements(model="x"), routes, h.stats)
    fleet = decision.as_dict()["candidates"][0]["fleet"]  # type: ignore[index]
    assert fleet["thermal"]["value"] == "warm"
    assert fleet["memory_fit"] == {
        "value": 0.33,
        "points": 0,
        "limit_gb": 7.0,
        "source": "ceiling",
    }


async def test_a_model_in_use_is_never_expected_unloaded() -> None:
    x = ModelSpec("x", size_gb=3.0, loaded=True)
    y = ModelSpec("y", size_gb=3.0, loaded=True)
    z = ModelSpec("z", size_gb=3.0)
    routes = _routes(_node("a", 7.0, x, y, z))
    h = Harness(routes)
    spec = routes.backend("a")
    assert spec is not None
    h.stats.mark_hot("a", "y")
    h.stats.add_waiting("a", "x")  # x is older but busy: y goes
    h.fleet.note_sent(Target(spec, z), routes)

    assert h.fleet.is_hot(Target(spec, x), routes)
    assert not h.fleet.is_hot(Target(spec, y), routes)


async def test_prewarm_never_unloads_a_model_on_the_runner_up(
    ollama_node: MockBackendProcess,
) -> None:
    other = ModelSpec("other", size_gb=5.0, loaded=True)
    cold = ModelSpec("m", size_gb=3.0)
    full = BackendSpec(
        "runner-up",
        ollama_node.base_url,
        kind="ollama",
        status="healthy",
        max_concurrency=10,
        memory_ceiling_gb=7.0,
        models=(cold, other),
    )
    routes = _routes(_backend("winner", capacity=10), full, pre_warm_threshold=3)
    h = Harness(routes)
    h.fleet.start()
    try:
        route = _route(routes, "winner", "runner-up")
        for _ in range(8):
            h.fleet.after_decision(route, routes)
            h.begin(route)
        assert not h.fleet.prewarm.is_running("runner-up", "m")
    finally:
        await h.fleet.stop()
    async with httpx.AsyncClient() as client:
        stats = (await client.get(f"{ollama_node.base_url}/_mock/stats")).json()
    assert stats.get("loads_total") == 0
