"""Prompt caching's pure parts: breakpoints, cached-token usage, prices."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.protocols import anthropic, responses
from gateway.protocols.anthropic.wire import usage_from_canonical, usage_to_canonical
from gateway.protocols.openai import ChatChunkReader
from gateway.protocols.prompt_cache import (
    MAX_BREAKPOINTS,
    add_breakpoints,
    cache_counts,
    count_breakpoints,
    usage_with_cache_timings,
)
from usage.limits.policy import Price

MARK = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}
TOOL = {"name": "t", "input_schema": {"type": "object"}}


def _body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "claude",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


# Breakpoints


def test_breakpoints_are_counted_wherever_the_messages_api_allows_them() -> None:
    body = _body(
        cache_control=MARK,
        system=[{"type": "text", "text": "s", "cache_control": HOUR}],
        tools=[{**TOOL, "cache_control": MARK}],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a", "cache_control": MARK},
                    {
                        "type": "tool_result",
                        "tool_use_id": "x",
                        "content": [
                            {"type": "text", "text": "r", "cache_control": MARK}
                        ],
                    },
                ],
            }
        ],
    )
    assert count_breakpoints(body) == 5
    # A tool's input schema may name a property cache_control: not a breakpoint.
    schema = {"type": "object", "properties": {"cache_control": {"type": "string"}}}
    assert count_breakpoints(_body(tools=[{"name": "t", "input_schema": schema}])) == 0


def test_breakpoints_go_after_the_tools_and_the_system_prompt() -> None:
    body = _body(system="be brief", tools=[TOOL, {**TOOL, "name": "u"}])
    marked = add_breakpoints(body)
    assert marked is not None
    assert marked["system"] == [
        {"type": "text", "text": "be brief", "cache_control": MARK}
    ]
    assert "cache_control" not in marked["tools"][0]
    assert marked["tools"][1] == {**TOOL, "name": "u", "cache_control": MARK}
    assert marked["messages"] == body["messages"]
    assert count_breakpoints(marked) == 2 <= MAX_BREAKPOINTS
    # The request given is left as it was.
    assert body["system"] == "be brief" and "cache_control" not in body["tools"][1]


def test_a_system_prompt_of_blocks_gets_its_last_block_marked() -> None:
    system = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    marked = add_breakpoints(_body(system=system))
    assert marked is not None
    assert marked["system"] == [system[0], {**system[1], "cache_control": MARK}]
    assert "tools" not in marked


@pytest.mark.parametrize(
    "body",
    [
        _body(),  # nothing worth caching
        _body(system=""),
        _body(system="s", cache_control=MARK),  # the client chose
        _body(system="s", tools=[{**TOOL, "cache_control": HOUR}]),
        _body(
            system="s",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a", "cache_control": MARK}],
                }
            ],
        ),
    ],
)
def test_no_breakpoints_are_added_when_the_client_set_some_or_nothing_fits(
    body: dict[str, Any],
) -> None:
    assert add_breakpoints(body) is None


# cache_control through the translators


def test_an_anthropic_requests_breakpoints_never_reach_the_canonical_form() -> None:
    canonical = anthropic.messages_to_canonical(
        _body(
            cache_control=MARK,
            system=[{"type": "text", "text": "s", "cache_control": HOUR}],
            tools=[{**TOOL, "cache_control": HOUR}],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a", "cache_control": HOUR}],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "b", "cache_control": MARK},
                        {"type": "tool_use", "id": "x", "name": "t", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "x",
                            "content": [
                                {"type": "text", "text": "r", "cache_control": HOUR}
                            ],
                            "cache_control": MARK,
                        }
                    ],
                },
            ],
        )
    )
    text = repr(canonical)
    assert "cache_control" not in text and "ttl" not in text and "ephemeral" not in text


def test_an_openai_requests_breakpoints_become_anthropic_blocks() -> None:
    body = anthropic.canonical_to_messages(
        {
            "model": "claude",
            "messages": [
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "s", "cache_control": HOUR}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a", "cache_control": {"type": "x"}},
                        {"type": "text", "text": "b", "cache_control": MARK},
                    ],
                },
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "t", "parameters": {"type": "object"}},
                    "cache_control": MARK,
                }
            ],
        }
    )
    assert body["system"] == [{"type": "text", "text": "s", "cache_control": HOUR}]
    # Only Anthropic's kind of breakpoint is carried.
    assert body["messages"][0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b", "cache_control": MARK},
    ]
    assert body["tools"][0]["cache_control"] == MARK


# Cached tokens


def test_anthropic_usage_keeps_cache_reads_and_writes_in_canonical_form() -> None:
    usage = {
        "input_tokens": 5,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 20,
        "output_tokens": 7,
    }
    canonical = usage_to_canonical(usage)
    assert canonical == {
        "prompt_tokens": 125,
        "completion_tokens": 7,
        "total_tokens": 132,
        "prompt_tokens_details": {"cached_tokens": 100, "cache_write_tokens": 20},
    }
    assert usage_from_canonical(canonical) == usage
    assert cache_counts(canonical, 125) == (100, 20)


def test_canonical_cached_tokens_reach_each_surface() -> None:
    reply = {
        "id": "chatcmpl-1",
        "choices": [{"message": {"role": "assistant", "content": "x"}}],
        "usage": {
            "prompt_tokens": 50,
            "completion_tokens": 2,
            "total_tokens": 52,
            "prompt_tokens_details": {"cached_tokens": 30, "cache_write_tokens": 5},
        },
    }
    message = anthropic.canonical_to_message(reply, "m")
    assert message["usage"] == {
        "input_tokens": 15,
        "output_tokens": 2,
        "cache_read_input_tokens": 30,
        "cache_creation_input_tokens": 5,
    }
    usage = responses.chat_to_response(reply, {}, response_id="r", created_at=0)[
        "usage"
    ]
    assert usage["input_tokens_details"] == {
        "cached_tokens": 30,
        "cache_write_tokens": 5,
    }


def test_an_anthropic_stream_reports_cache_counts_once() -> None:
    reader = anthropic.MessageStreamReader()
    cache = {"cache_read_input_tokens": 40, "cache_creation_input_tokens": 8}
    start = {"id": "msg_1", "model": "m", "usage": {"input_tokens": 2, **cache}}
    reader.feed({"type": "message_start", "message": start})
    reader.feed(
        {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 3, **cache}}
    )
    chunks = reader.feed({"type": "message_stop"})
    assert chunks[-1]["usage"]["prompt_tokens"] == 50
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 40,
        "cache_write_tokens": 8,
    }


def test_llamacpps_timings_become_cached_tokens() -> None:
    chunk = {
        "choices": [],
        "usage": {"prompt_tokens": 30, "completion_tokens": 1, "total_tokens": 31},
        "timings": {"cache_n": 24, "prompt_n": 6},
    }
    [read] = ChatChunkReader().feed(chunk)
    assert read["usage"]["prompt_tokens_details"] == {"cached_tokens": 24}
    assert "prompt_tokens_details" not in chunk["usage"]  # not changed in place
    older = {"usage": {"prompt_tokens": 10}, "tokens_cached": 99}
    assert usage_with_cache_timings(older) == {
        "prompt_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 10},
    }
    # A usage block that says it itself wins.
    said = {
        "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 3}}
    }
    assert (
        usage_with_cache_timings({**said, "timings": {"cache_n": 8}}) == said["usage"]
    )


@pytest.mark.parametrize(
    ("details", "expected"),
    [
        (None, (0, 0)),
        ({"cached_tokens": 80}, (80, 0)),
        ({"cached_tokens": 500}, (100, 0)),  # never more than the prompt
        ({"cached_tokens": 80, "cache_write_tokens": 50}, (80, 20)),
        ({"cached_tokens": -3, "cache_write_tokens": True}, (0, 0)),
    ],
)
def test_cache_counts_are_bounded_by_the_prompt(
    details: dict[str, Any] | None, expected: tuple[int, int]
) -> None:
    usage = {"prompt_tokens": 100, "prompt_tokens_details": details}
    assert cache_counts(usage, 100) == expected


# Prices


def test_cached_and_written_tokens_have_prices_of_their_own() -> None:
    price = Price(
        input_nanos=3000,
        output_nanos=15000,
        cached_input_nanos=300,
        cache_write_nanos=3750,
    )
    # 1000 prompt tokens: 700 read, 200 written, 100 uncached; 10 out.
    assert (
        price.cost(1000, 10, 700, 200)
        == 100 * 3000 + 700 * 300 + 200 * 3750 + 10 * 15000
    )
    # Without cache prices they cost the input price.
    plain = Price(input_nanos=3000, output_nanos=15000)
    assert plain.cost(1000, 10, 700, 200) == plain.cost(1000, 10) == 3_150_000
