"""Pattern aliases (``claude-*``): matched after exact names and exact aliases,
the longest pattern first; in the router, the explain record and the snapshot."""

from __future__ import annotations

import time

import pytest

from routing.core import LiveStats, ModelNotFound, RequestRequirements, Router
from routing.core.aliases import (
    CACHE_SIZE,
    AliasPatterns,
    check_alias_pattern,
    matches_alias_pattern,
)
from routing.explain import render_decision
from tests.routing.core_builders import backend, select, snapshot

CLAUDE = "claude-sonnet-4-6"
HAIKU = "claude-haiku-4-5-20251001"


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("claude-*", CLAUDE, True),
        ("claude-*", "claude-", True),
        ("claude-*", "claude", False),
        ("claude-*", "my-claude-x", False),
        ("*-haiku-*", HAIKU, True),
        ("gpt-4?", "gpt-4o", True),
        ("gpt-4?", "gpt-4", False),
        ("gpt-4?", "gpt-4o-mini", False),
        ("*", "anything at all", True),
        ("a*b*c", "a-x-b-y-c", True),
        ("a*b*c", "a-x-c-y-b", False),
        ("ab*ba", "aba", False),  # the prefix and the suffix overlap
        ("ab*ba", "abba", True),
        ("*-mini", "gpt-4o-mini", True),
        ("llama3.1:*", "llama3.1:8b", True),
        ("llama3.1:*", "llama3x1:8b", False),  # '.' is a dot, not "any"
        ("Claude-*", CLAUDE, False),  # case counts, as for exact names
    ],
)
def test_a_pattern_covers_the_names_a_shell_glob_would(
    pattern: str, name: str, expected: bool
) -> None:
    assert matches_alias_pattern(pattern, name) is expected


def test_matching_stays_fast_on_a_hostile_name() -> None:
    # Many stars over a long name that almost matches: a backtracking regular
    # expression takes exponential time here; the glob match is bounded.
    pattern = "*a" * 40 + "*b"
    name = "a" * 256
    started = time.perf_counter()
    assert not matches_alias_pattern(pattern, name)
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        ("claude-[0-9]*", "only '*'"),
        ("claude-{a,b}", "only '*'"),
        ("c" * 201 + "*", "at most 200"),
    ],
)
def test_only_star_and_question_mark_make_a_valid_pattern(
    pattern: str, problem: str
) -> None:
    assert problem in (check_alias_pattern(pattern) or "")


def test_a_pattern_alias_serves_every_name_it_covers() -> None:
    snap = snapshot(backend("a", "llama3:8b"), aliases={"claude-*": "llama3:8b"})
    for name in (CLAUDE, HAIKU):
        route = select(snap, name)
        assert route.target.model.name == "llama3:8b"
        assert route.decision.via == "alias"
        assert route.decision.alias_pattern == "claude-*"
    # The pattern is no model: /v1/models and friends never see it as one.
    assert "claude-*" not in snap.aliases
    assert snap.alias_patterns.as_dict() == {"claude-*": "llama3:8b"}


def test_exact_names_and_exact_aliases_win_over_patterns() -> None:
    snap = snapshot(
        backend("a", "llama3:8b", "qwen:7b"),
        backend("c", "claude-opus-4"),
        aliases={"claude-*": "llama3:8b", HAIKU: "qwen:7b"},
    )
    assert select(snap, "claude-opus-4").target.backend.name == "c"
    assert select(snap, "claude-opus-4").decision.alias_pattern is None
    assert select(snap, HAIKU).target.model.name == "qwen:7b"
    assert select(snap, HAIKU).decision.alias_pattern is None
    assert select(snap, CLAUDE).target.model.name == "llama3:8b"


def test_the_longest_pattern_wins() -> None:
    snap = snapshot(
        backend("a", "llama3:8b", "qwen:0.5b", "mistral:7b"),
        aliases={
            "claude-*": "llama3:8b",
            "claude-*haiku*": "qwen:0.5b",
            "*": "mistral:7b",
        },
    )
    assert select(snap, HAIKU).target.model.name == "qwen:0.5b"
    assert select(snap, HAIKU).decision.alias_pattern == "claude-*haiku*"
    assert select(snap, CLAUDE).target.model.name == "llama3:8b"
    assert select(snap, "gpt-4o").target.model.name == "mistral:7b"
    assert list(snap.alias_patterns.as_dict()) == ["claude-*haiku*", "claude-*", "*"]


def test_a_served_model_that_is_down_is_not_sent_to_a_pattern() -> None:
    # The pattern is for names nobody serves; a served model that is down is
    # a 503 (or its own fallback chain), not a silent swap of model.
    snap = snapshot(
        backend("a", "llama3:8b"),
        backend("c", "claude-opus-4", status="unhealthy"),
        aliases={"claude-*": "llama3:8b"},
    )
    decision = Router().explain(
        RequestRequirements(model="claude-opus-4"), snap, LiveStats()
    )
    assert decision.error is not None and decision.error.status == 503


def test_a_pattern_whose_target_nobody_serves_is_a_404_naming_the_pattern() -> None:
    snap = snapshot(backend("a", "llama3:8b"), aliases={"claude-*": "llama3:70b"})
    with pytest.raises(ModelNotFound) as caught:
        select(snap, CLAUDE)
    assert caught.value.message == (
        f"Model '{CLAUDE}' not found: the alias pattern 'claude-*' sends it to "
        "'llama3:70b', and no backend serves 'llama3:70b'"
    )


def test_a_names_that_no_pattern_covers_is_still_a_404() -> None:
    snap = snapshot(backend("a", "llama3:8b"), aliases={"claude-*": "llama3:8b"})
    with pytest.raises(ModelNotFound, match="Model 'gpt-4' not found$"):
        select(snap, "gpt-4")


def test_fallback_chains_of_the_pattern_and_its_target_are_followed() -> None:
    snap = snapshot(
        backend("a", "llama3:70b", status="unhealthy"),
        backend("b", "mistral:7b"),
        backend("c", "qwen:7b"),
        aliases={"claude-*": "llama3:70b"},
        fallbacks={"claude-*": ["mistral:7b"], "llama3:70b": ["qwen:7b"]},
    )
    route = select(snap, CLAUDE)
    assert route.decision.via == "fallback"
    assert route.target.model.name == "mistral:7b"
    assert [t.model.name for t in route.retry_targets] == ["qwen:7b"]
    assert snap.models_for(CLAUDE) == (CLAUDE, "llama3:70b", "mistral:7b", "qwen:7b")
    assert snap.models_for("claude-*") == ("llama3:70b", "mistral:7b", "qwen:7b")


def test_a_fallback_step_covered_by_a_pattern_resolves_to_its_target() -> None:
    snap = snapshot(
        backend("a", "llama3:8b"),
        aliases={"claude-*": "llama3:8b"},
        fallbacks={"gpt-4": [CLAUDE]},
    )
    assert snap.fallbacks["gpt-4"] == ("llama3:8b",)
    assert select(snap, "gpt-4").target.model.name == "llama3:8b"


def test_invalid_patterns_are_left_out_and_reported() -> None:
    snap = snapshot(
        backend("a", "llama3:8b"),
        aliases={"claude-[0-9]*": "llama3:8b", "gpt-*": "o-*", "x-*": "gpt-4"},
    )
    assert snap.alias_patterns.as_dict() == {"x-*": "gpt-4"}
    assert [p.split(":")[0] for p in snap.alias_problems] == [
        "Alias pattern 'claude-[0-9]*' is ignored",
        "Alias pattern 'gpt-*' is ignored",
    ]


def test_a_pattern_targeting_an_exact_alias_is_reported() -> None:
    snap = snapshot(
        backend("a", "llama3:8b"), aliases={"gpt-4": "llama3:8b", "claude-*": "gpt-4"}
    )
    assert any("'claude-*' points to 'gpt-4'" in p for p in snap.alias_problems)


def test_the_name_cache_is_bounded() -> None:
    patterns = AliasPatterns({"claude-*": "llama3:8b"})
    for i in range(CACHE_SIZE + 500):
        assert patterns.match(f"claude-{i}") == ("claude-*", "llama3:8b")
        assert patterns.match(f"gpt-{i}") is None
    assert len(patterns._cache) == CACHE_SIZE


def test_explain_shows_the_pattern() -> None:
    snap = snapshot(backend("a", "llama3:8b"), aliases={"claude-*": "llama3:8b"})
    decision = Router().explain(RequestRequirements(model=HAIKU), snap, LiveStats())
    record = decision.as_dict()
    assert record["alias_pattern"] == "claude-*"
    assert record["resolved_model"] == "llama3:8b"
    text = render_decision(record, explain=True)
    assert text.splitlines()[:2] == [
        f"{HAIKU} -> a serving llama3:8b (via alias)",
        "(the alias pattern 'claude-*' covers this name)",
    ]
    assert "llama3:8b (alias pattern 'claude-*'): routed" in text
