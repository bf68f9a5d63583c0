"""The decision record, the snapshot's guarantees, and concurrent decisions.

Covers AC-15 (structurally: the work per decision does not grow with the
number of models; timings belong to the benchmark) and AC-16 of the router
spec; the pipeline itself is tested in test_router.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from typing import Any

import pytest

from routing.core import (
    LiveStats,
    NoHealthyBackend,
    RequestRequirements,
    Router,
)
from tests.routing.core_builders import backend, model, select, snapshot

pytestmark = pytest.mark.mode_independent

NO_CAPS = {"vision": "no", "tools": "no", "json_mode": "no"}

# The decision record


def test_decision_lists_candidates_scores_and_exclusions() -> None:
    stats = LiveStats()
    stats.begin("b")
    snap = snapshot(
        backend("a", model("llama3", context_length=2048), priority=0),
        backend("b", model("llama3", context_length=8192), priority=5),
        backend(
            "c", model("llama3", context_length=8192), priority=5, avg_latency_ms=200.0
        ),
        backend("d", "llama3", status="unhealthy"),
        version=42,
    )
    route = select(snap, "llama3", stats=stats, estimated_tokens=3000)
    decision = route.decision.as_dict()
    assert decision["snapshot_version"] == 42
    assert decision["strategy"] == "smart"
    assert decision["chosen"] == {"backend": "b", "model": "llama3"}
    assert decision["retry_order"] == [{"backend": "c", "model": "llama3"}]
    assert decision["candidates"] == [
        {
            "backend": "b",
            "model": "llama3",
            "priority": 5,
            "in_flight": 1,
            "max_concurrency": None,
            "latency_ms": None,
            "capabilities": NO_CAPS,
            "score": {"priority": 95.0, "load": 99.0, "latency": 100.0, "total": 97.2},
        },
        {
            "backend": "c",
            "model": "llama3",
            "priority": 5,
            "in_flight": 0,
            "max_concurrency": None,
            "latency_ms": 200.0,
            "capabilities": NO_CAPS,
            "score": {"priority": 95.0, "load": 100.0, "latency": 80.0, "total": 93.5},
        },
    ]
    assert decision["excluded"] == [
        {
            "backend": "a",
            "model": "llama3",
            "reasons": ["context_too_short"],
            "detail": "context length 2048 is below the ~3000 tokens estimated",
            "capabilities": NO_CAPS,
        },
        {
            "backend": "d",
            "model": "llama3",
            "reasons": ["unhealthy"],
            "detail": "backend unhealthy",
            "capabilities": NO_CAPS,
        },
    ]
    assert decision["error"] is None
    assert decision["requirements"]["estimated_tokens"] == 3000
    assert json.loads(json.dumps(decision)) == decision


def test_failed_decision_carries_the_error_in_its_record() -> None:
    snap = snapshot(backend("a", "m", status="draining"))
    decision = Router().explain(RequestRequirements(model="m"), snap, LiveStats())
    record = decision.as_dict()
    assert record["chosen"] is None
    assert record["error"] == {
        "status": 503,
        "message": "No healthy backend available for model 'm' (1 draining)",
        "type": "service_unavailable_error",
        "param": None,
        "code": "no_healthy_backend",
    }
    assert record["attempts"][0]["outcome"] == "no_healthy_backend"


def test_retry_order_never_includes_the_chosen_backend_and_respects_max_retries() -> (
    None
):
    snap = snapshot(
        *(backend(f"b{i}", "m", priority=i) for i in range(5)), max_retries=2
    )
    route = select(snap, "m")
    assert route.target.backend.name == "b0"
    assert [t.backend.name for t in route.decision.retry_order] == [
        "b1",
        "b2",
        "b3",
        "b4",
    ]
    assert [t.backend.name for t in route.retry_targets] == ["b1", "b2"]


def test_round_robin_retry_order_continues_the_rotation() -> None:
    snap = snapshot(*(backend(n, "m") for n in "abc"), strategy="round_robin")
    router = Router()
    select(snap, "m", router=router)
    route = select(snap, "m", router=router)
    assert route.target.backend.name == "b"
    assert [t.backend.name for t in route.retry_targets] == ["c", "a"]


def test_explain_does_not_take_a_round_robin_turn() -> None:
    snap = snapshot(*(backend(n, "m") for n in "abc"), strategy="round_robin")
    router, stats = Router(), LiveStats()
    requirements = RequestRequirements(model="m")
    router.select(requirements, snap, stats)
    for _ in range(3):
        chosen = router.explain(requirements, snap, stats).chosen
        assert chosen is not None and chosen.backend.name == "b"
    assert router.select(requirements, snap, stats).target.backend.name == "b"


def test_api_key_never_appears_in_repr_or_decision() -> None:
    snap = snapshot(backend("a", "m", api_key="sk-very-secret"))
    route = select(snap, "m")
    assert route.target.backend.api_key == "sk-very-secret"
    assert "sk-very-secret" not in repr(route.target)
    assert "sk-very-secret" not in repr(snap)
    assert "sk-very-secret" not in json.dumps(route.decision.as_dict())


def test_snapshot_carries_connection_details_for_the_proxy() -> None:
    snap = snapshot(
        backend(
            "a",
            "m",
            kind="vllm",
            api_key="k",
            request_timeout=12.5,
            max_concurrency=8,
            id=7,
        )
    )
    target = select(snap, "m").target
    assert (target.backend.base_url, target.backend.kind) == (
        "http://a.lan:11434",
        "vllm",
    )
    assert (target.backend.request_timeout, target.backend.max_concurrency) == (12.5, 8)
    assert target.backend.id == 7
    assert snap.backend("a") is target.backend


def test_snapshot_cannot_be_modified() -> None:
    snap = snapshot(backend("a", "m"), aliases={"x": "m"})
    with pytest.raises(TypeError):
        snap.aliases["y"] = "m"  # type: ignore[index]
    with pytest.raises(AttributeError):
        snap.version = 2  # type: ignore[misc]


def test_snapshot_rejects_duplicate_backend_names() -> None:
    with pytest.raises(ValueError, match="Duplicate backend name 'a'"):
        snapshot(backend("a", "m"), backend("a", "n"))


def test_served_models_lists_enabled_models_only() -> None:
    snap = snapshot(
        backend("a", "m1", model("m2", enabled=False)),
        backend("b", "m3", enabled=False),
    )
    assert snap.served_models() == ("m1",)


# AC-15: performance (structural; timings are measured by the benchmark)


class CountingStats(LiveStats):
    """LiveStats that counts how many backends a decision looked at."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        outer = self

        class Counting(dict[str, int]):
            def get(self, key: str, default: Any = None) -> Any:
                outer.reads[key] += 1
                return super().get(key, default)

        self._in_flight = Counting()


def test_a_decision_only_looks_at_the_backends_of_the_requested_model() -> None:
    """AC-15: the work per decision does not grow with the number of models."""
    backends = [
        backend(f"b{i:03d}", *(f"model-{i}-{j}" for j in range(10))) for i in range(100)
    ]
    backends.append(backend("target-1", "wanted"))
    backends.append(backend("target-2", "wanted"))
    snap = snapshot(*backends)
    stats = CountingStats()
    select(snap, "wanted", stats=stats)
    assert set(stats.reads) == {"target-1", "target-2"}


# AC-16: concurrent decisions


def test_concurrent_threads_keep_round_robin_exact_while_snapshots_swap() -> None:
    """AC-16: many threads deciding while another swaps the snapshot."""
    backends = [backend(n, "m") for n in ("a", "b", "c", "d")]
    current = {"snapshot": snapshot(*backends, strategy="round_robin", version=1)}
    router, stats = Router(), LiveStats()
    requirements = RequestRequirements(model="m")
    threads_count, per_thread = 8, 1000
    results: list[Counter[str]] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    start = threading.Barrier(threads_count + 1)

    def swap() -> None:
        start.wait()
        version = 1
        # Swap every 0.2 ms: often enough to race the deciders hundreds of
        # times, without a busy loop starving them of the GIL (that took 50 s).
        while not stop.wait(0.0002):
            version += 1
            current["snapshot"] = snapshot(
                *backends, strategy="round_robin", version=version
            )

    def decide() -> None:
        counts: Counter[str] = Counter()
        start.wait()
        try:
            for _ in range(per_thread):
                route = router.select(requirements, current["snapshot"], stats)
                stats.begin(route.target.backend.name)
                counts[route.target.backend.name] += 1
                stats.end(route.target.backend.name)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        results.append(counts)

    swapper = threading.Thread(target=swap)
    workers = [threading.Thread(target=decide) for _ in range(threads_count)]
    for thread in [swapper, *workers]:
        thread.start()
    for worker in workers:
        worker.join()
    stop.set()
    swapper.join()

    assert errors == []
    assert current["snapshot"].version > 1  # swaps really happened meanwhile
    total = sum(results, Counter())
    assert total == {n: threads_count * per_thread // 4 for n in "abcd"}
    assert all(stats.in_flight(n) == 0 for n in "abcd")


async def test_concurrent_asyncio_tasks_keep_round_robin_exact() -> None:
    """AC-16: tasks interleave at every await; the rotation stays exact."""
    snap = snapshot(*(backend(n, "m") for n in "abc"), strategy="round_robin")
    router, stats = Router(), LiveStats()
    requirements = RequestRequirements(model="m")
    chosen: list[str] = []

    async def handle() -> None:
        route = router.select(requirements, snap, stats)
        stats.begin(route.target.backend.name)
        try:
            await asyncio.sleep(0)
            chosen.append(route.target.backend.name)
        finally:
            stats.end(route.target.backend.name)

    await asyncio.gather(*(handle() for _ in range(300)))
    assert Counter(chosen) == {"a": 100, "b": 100, "c": 100}


def test_concurrent_smart_decisions_respect_max_concurrency_with_try_begin() -> None:
    snap = snapshot(backend("a", "m", max_concurrency=5))
    router, stats = Router(), LiveStats()
    requirements = RequestRequirements(model="m")
    admitted: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(20)

    def request() -> None:
        start.wait()
        try:
            target = router.select(requirements, snap, stats).target
        except NoHealthyBackend:
            ok = False
        else:
            ok = stats.try_begin(target.backend)
        with lock:
            admitted.append(ok)

    threads = [threading.Thread(target=request) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert admitted.count(True) == 5
    assert stats.in_flight("a") == 5
