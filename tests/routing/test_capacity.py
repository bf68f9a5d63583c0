"""Learned capacity in the router core: reported memory, OOM pauses, concurrency."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from routing.core import (
    BackendSpec,
    FleetPolicy,
    LiveStats,
    ModelSpec,
    RequestRequirements,
    Router,
    RouterSnapshot,
    make_policy,
)
from routing.core.capacity import (
    OOM_PAUSE_SECONDS,
    cold_load_pause,
    note_out_of_memory,
    parse_out_of_memory,
)
from routing.core.decision import Decision
from routing.core.fleet import learned_concurrency
from routing.explain import render_decision

pytestmark = pytest.mark.mode_independent

NOW = 1_700_000_000.0
FIXTURES = Path(__file__).parent.parent / "fixtures" / "out_of_memory" / "errors.json"
OLLAMA_OOM = (
    b'{"error":"model requires more system memory (8.0 GiB) than is available '
    b'(2.0 GiB)"}'
)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def live(wall: Clock | None = None) -> LiveStats:
    return LiveStats(clock=Clock(100.0), wall_clock=wall or Clock(NOW))


def node(name: str, *models: ModelSpec, **fields: Any) -> BackendSpec:
    fields.setdefault("status", "healthy")
    return BackendSpec(
        name=name,
        base_url=f"http://{name}.lan:11434",
        kind="ollama",
        models=models or (ModelSpec("m", size_gb=8.0),),
        **fields,
    )


def decide(*backends: BackendSpec, stats: LiveStats | None = None) -> Decision:
    snap = RouterSnapshot.build(
        version=1, backends=backends, policy=make_policy(strategy="fleet")
    )
    return Router().explain(RequestRequirements(model="m"), snap, stats or live())


def chosen(decision: Decision) -> str:
    assert decision.chosen is not None, decision.as_dict()["error"]
    return decision.chosen.backend.name


def excluded(decision: Decision) -> dict[str, tuple[list[str], str]]:
    return {
        e["backend"]: (e["reasons"], e["detail"])
        for e in decision.as_dict()["excluded"]
    }


# What servers say ----------------------------------------------------------------


def test_the_servers_out_of_memory_words_are_recognised() -> None:
    fixtures = json.loads(FIXTURES.read_text())

    for case in fixtures["oom"]:
        found = parse_out_of_memory(case["body"].encode())
        assert found is not None, case["body"]
        assert (found.required_gb, found.available_gb) == (
            case["required_gb"],
            case["available_gb"],
        )
        assert "memory" in found.detail or "allocate" in found.detail
    for body in fixtures["other"]:
        assert parse_out_of_memory(body.encode()) is None, body


# Memory reported by the node -------------------------------------------------------


def test_memory_the_node_reports_in_use_beyond_its_listed_models_changes_the_choice() -> (
    None
):
    # a is preferred (priority) and, by the models Nexus lists, empty; its
    # /api/ps says 20 GB are taken by models Nexus does not route to.
    quiet = node("a", memory_ceiling_gb=24.0, priority=0)
    busy = node("a", memory_ceiling_gb=24.0, priority=0, memory_reported_used_gb=20.0)
    other = node("b", memory_ceiling_gb=24.0, priority=5)

    assert chosen(decide(quiet, other)) == "a"
    decision = decide(busy, other)
    assert chosen(decision) == "b"
    reasons, detail = excluded(decision)["a"]
    assert reasons == ["no_memory"]
    assert "ceiling 24.00 GB, 20.00 GB in use" in detail


def test_the_reported_total_is_the_limit_unless_the_operator_set_a_ceiling() -> None:
    reported = node("a", memory_total_gb=6.0)
    overridden = node("a", memory_total_gb=6.0, memory_ceiling_gb=40.0)

    decision = decide(reported, node("b", priority=20))
    assert chosen(decision) == "b"
    assert "memory reported 6.00 GB" in excluded(decision)["a"][1]
    fit = decide(overridden).as_dict()["candidates"][0]["fleet"]["memory_fit"]  # type: ignore[index]
    assert (fit["limit_gb"], fit["source"], fit["points"]) == (40.0, "ceiling", 20)


# Cold-load pauses -------------------------------------------------------------------


def test_repeated_oom_load_failures_pause_cold_loads_until_the_cool_down_ends() -> None:
    wall = Clock(NOW)
    stats = live(wall)
    a = node("a", ModelSpec("m", size_gb=8.0), ModelSpec("hot", loaded=True))
    b = node("b", priority=20)
    oom = parse_out_of_memory(OLLAMA_OOM)
    assert oom is not None

    note_out_of_memory(stats, a, "m", oom)
    assert chosen(decide(a, b, stats=stats)) == "a"  # one failure: not yet
    wall.now += 5
    note_out_of_memory(stats, a, "m", oom)
    decision = decide(a, b, stats=stats)

    assert chosen(decision) == "b"
    reasons, detail = excluded(decision)["a"]
    assert reasons == ["cold_loads_paused"]
    assert "2 out-of-memory load failures" in detail
    assert "requires more system memory" in detail
    text = render_decision(decision.as_dict(), explain=True)
    assert "excluded a: not loaded, and the node is paused for cold loads" in text
    # A model it has loaded still goes there.
    hot = Router().explain(
        RequestRequirements(model="hot"),
        RouterSnapshot.build(backends=(a, b), policy=make_policy(strategy="fleet")),
        stats,
    )
    assert chosen(hot) == "a"
    wall.now += OOM_PAUSE_SECONDS
    assert chosen(decide(a, b, stats=stats)) == "a"


def test_a_report_showing_memory_freed_after_the_failures_ends_the_pause() -> None:
    stats = live()
    a = node("a", memory_reported_used_gb=14.0, memory_reported_at=NOW - 60)
    oom = parse_out_of_memory(OLLAMA_OOM)
    assert oom is not None
    note_out_of_memory(stats, a, "m", oom)
    note_out_of_memory(stats, a, "m", oom)
    same = node("a", memory_reported_used_gb=14.0, memory_reported_at=NOW + 1)
    freed = node("a", memory_reported_used_gb=6.0, memory_reported_at=NOW + 1)

    assert cold_load_pause(a, stats, NOW + 2)
    assert cold_load_pause(same, stats, NOW + 2)
    assert cold_load_pause(freed, stats, NOW + 2) == ""


def test_an_oom_error_teaches_the_nodes_memory() -> None:
    stats = live()
    # 14 GB reported in use + 2 GiB available: 16.15 GB.
    a = node("a", memory_reported_used_gb=14.0)
    oom = parse_out_of_memory(OLLAMA_OOM)
    assert oom is not None
    note_out_of_memory(stats, a, "m", oom)

    # One failure pauses nothing, but the 8 GB model is known not to fit now.
    reasons, detail = excluded(decide(a, stats=stats))["a"]
    assert reasons == ["no_memory"]
    assert "memory learned from an out-of-memory error 16.15 GB" in detail
    small = node("a", ModelSpec("m", size_gb=1.0), memory_reported_used_gb=14.0)
    signals = decide(small, stats=stats).as_dict()
    memory = signals["candidates"][0]["fleet"]["memory_fit"]  # type: ignore[index]
    assert (memory["limit_gb"], memory["source"]) == (16.15, "oom")


def test_memory_pressure_pauses_cold_loads_while_reported() -> None:
    pressed = node("a", memory_pressure=True)
    relieved = node("a")

    decision = decide(pressed, node("b", priority=20))
    assert chosen(decision) == "b"
    assert excluded(decision)["a"] == (
        ["cold_loads_paused"],
        (
            "not loaded, and the node is paused for cold loads: the node reports "
            "memory pressure"
        ),
    )
    assert chosen(decide(relieved, node("b", priority=20))) == "a"


# Concurrency ---------------------------------------------------------------------


def test_concurrency_comes_from_slots_or_from_free_memory_and_the_kv_footprint() -> (
    None
):
    stats, policy = live(), FleetPolicy()
    # 8 GB model, 1 MB of KV per token x 4096 tokens = 4.1 GB per request.
    m = ModelSpec("m", size_gb=8.0, context_length=4096, kv_bytes_per_token=1_000_000)

    assert learned_concurrency(node("a", m, slots=4), m, stats, policy, NOW) == 4
    assert learned_concurrency(node("a", m), m, stats, policy, NOW) is None
    # 24 GB: 16 left once loaded, 3 more footprints of 4.1 GB.
    assert (
        learned_concurrency(node("a", m, memory_ceiling_gb=24.0), m, stats, policy, NOW)
        == 4
    )
    # Less than one footprint left: one at a time.
    assert (
        learned_concurrency(node("a", m, memory_ceiling_gb=10.0), m, stats, policy, NOW)
        == 1
    )
