"""Comparing a shadow's answer with the client's: overlap, tools, JSON."""

from __future__ import annotations

import pytest

from routing.core.shadow_compare import compare, summarize, text_similarity, wants_json

pytestmark = pytest.mark.mode_independent


def _reply(text: str = "", tools: tuple[str, ...] = ()) -> dict[str, object]:
    message: dict[str, object] = {"role": "assistant", "content": text}
    if tools:
        message["tool_calls"] = [
            {"id": f"c{n}", "type": "function", "function": {"name": name}}
            for n, name in enumerate(tools)
        ]
    return {
        "choices": [{"message": message, "finish_reason": "stop"}],
        "usage": {"completion_tokens": 7},
    }


def test_similarity_is_word_overlap() -> None:
    assert text_similarity("The cat sat.", "the CAT sat") == 1.0
    assert text_similarity("a b c d", "a b x y") == 0.5
    assert text_similarity("one", "two") == 0.0
    assert text_similarity("", "") == 1.0


def test_tool_names_and_json_are_compared() -> None:
    primary = summarize(_reply(tools=("search",)))
    assert primary.tool_names == ("search",)
    assert primary.completion_tokens == 7
    assert compare(primary, summarize(_reply(tools=("search",))), False).tools_match
    assert not compare(primary, summarize(_reply("no tool")), False).tools_match
    assert (
        compare(summarize(_reply("x")), summarize(_reply("y")), False).tools_match
        is None
    )
    asked = {"response_format": {"type": "json_object"}}
    assert wants_json(asked) and not wants_json({})
    assert compare(summarize(None), summarize(_reply('{"a": 1}')), True).json_valid
    assert (
        compare(summarize(None), summarize(_reply("{a: 1")), True).json_valid is False
    )


def test_unreadable_replies_compare_as_empty() -> None:
    assert summarize({"choices": "nonsense"}).text == ""
    assert summarize(None).finish_reason == ""
