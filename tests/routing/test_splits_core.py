"""Weighted splits in the router core: shares, stickiness, side fallbacks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from routing.core import (
    LiveStats,
    NoHealthyBackend,
    RequestRequirements,
    Router,
    make_policy,
)
from routing.core.traffic import Split, SplitSide, hash_point, split_problem
from routing.core.types import RouterSnapshot
from tests.routing.core_builders import backend

pytestmark = pytest.mark.mode_independent


def _snapshot(
    split: Split, fallbacks: dict[str, list[str]] | None = None, **down: bool
) -> RouterSnapshot:
    return RouterSnapshot.build(
        version=1,
        backends=[
            backend(
                "a", "llama3:8b", status="unhealthy" if down.get("a") else "healthy"
            ),
            backend(
                "b", "qwen2.5:7b", status="unhealthy" if down.get("b") else "healthy"
            ),
            backend("c", "mistral:7b"),
            backend("d", "phi3"),
        ],
        fallbacks=fallbacks,
        policy=make_policy(),
        splits=[split],
    )


CHAT = Split("chat", (SplitSide("llama3:8b", 90), SplitSide("qwen2.5:7b", 10)))


def _side(router: Router, snap: RouterSnapshot, key: str = "") -> str:
    route = router.select(
        RequestRequirements(model="chat"), snap, LiveStats(), split_key=key
    )
    assert route.decision.split is not None
    assert route.decision.split.side == route.target.model.name
    return route.decision.split.side


def test_ten_thousand_request_decisions_land_within_one_percent_of_the_weights() -> (
    None
):
    snap = _snapshot(Split("chat", CHAT.sides, sticky="request"))
    router = Router(rng=random.Random(7))
    counts = Counter(_side(router, snap) for _ in range(10_000))
    assert abs(counts["qwen2.5:7b"] / 10_000 - 0.10) < 0.01
    assert abs(counts["llama3:8b"] / 10_000 - 0.90) < 0.01


def test_ten_thousand_keys_land_within_one_percent_of_the_weights() -> None:
    snap = _snapshot(CHAT)
    router = Router()
    counts = Counter(_side(router, snap, f"key-{n}") for n in range(10_000))
    assert abs(counts["qwen2.5:7b"] / 10_000 - 0.10) < 0.01


def test_a_sticky_key_never_switches_sides() -> None:
    snap = _snapshot(CHAT)
    routers = [Router(rng=random.Random(seed)) for seed in range(3)]
    for n in range(300):
        key = f"nx-{n:04d}"
        sides = {_side(router, snap, key) for router in routers for _ in range(5)}
        assert len(sides) == 1, key
    # The same point in every process: a hash, no state.
    assert hash_point("chat", "nx-0001") == hash_point("chat", "nx-0001")
    assert hash_point("chat", "nx-0001") != hash_point("code", "nx-0001")


def test_growing_a_side_only_moves_keys_into_it() -> None:
    before = _snapshot(CHAT)
    after = _snapshot(
        Split("chat", (SplitSide("llama3:8b", 80), SplitSide("qwen2.5:7b", 20)))
    )
    router = Router()
    for n in range(2000):
        key = f"k{n}"
        if _side(router, before, key) == "qwen2.5:7b":
            assert _side(router, after, key) == "qwen2.5:7b"


def test_each_side_falls_back_through_its_own_chain() -> None:
    chains = {"llama3:8b": ["mistral:7b"], "qwen2.5:7b": ["phi3"]}
    router = Router()
    keys = {"llama": "", "qwen": ""}
    for n in range(200):
        side = _side(router, _snapshot(CHAT), f"k{n}")
        keys["llama" if side == "llama3:8b" else "qwen"] = f"k{n}"
    down = _snapshot(CHAT, chains, a=True, b=True)
    llama = router.select(
        RequestRequirements(model="chat"), down, LiveStats(), split_key=keys["llama"]
    )
    qwen = router.select(
        RequestRequirements(model="chat"), down, LiveStats(), split_key=keys["qwen"]
    )
    assert llama.target.backend.name == "c"  # llama3:8b's chain
    assert qwen.target.backend.name == "d"  # qwen2.5:7b's chain
    assert llama.decision.requested_model == "chat"
    assert llama.decision.as_dict()["split"]["side"] == "llama3:8b"
    # Without a chain, a side that is down fails: never the other side.
    only_down = _snapshot(CHAT, b=True)
    with pytest.raises(NoHealthyBackend) as caught:
        router.select(
            RequestRequirements(model="chat"),
            only_down,
            LiveStats(),
            split_key=keys["qwen"],
        )
    assert caught.value.decision.split.side == "qwen2.5:7b"


def test_split_shapes_are_checked() -> None:
    assert split_problem("chat", (), "key") is not None
    assert "itself" in (split_problem("chat", (SplitSide("chat", 1),), "key") or "")
    assert "twice" in (
        split_problem("c", (SplitSide("a", 1), SplitSide("a", 2)), "key") or ""
    )
    assert "weight" in (split_problem("c", (SplitSide("a", 0),), "key") or "")
    with pytest.raises(ValueError):
        Split("c", (SplitSide("a", 1),), sticky="user")


def test_the_split_name_lists_every_sides_models() -> None:
    snap = _snapshot(CHAT, {"qwen2.5:7b": ["phi3"]})
    assert snap.models_for("chat") == ("llama3:8b", "qwen2.5:7b", "phi3")
