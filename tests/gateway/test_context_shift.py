"""Context shift's parts: recognising each server's overflow, and the trim.

The overflow bodies are the servers' own, recorded in
tests/fixtures/context_overflow/ (each names where it was seen); the mock
(nexus_mock.overflow) answers the same shapes, checked here too.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.context_limits import CONTEXT_GROUP, ContextLimits, SharedContextLimits
from gateway.proxy.context_shift import (
    estimate,
    recognise,
    shrink,
    trim_messages,
)
from nexus_lib.groups import listen_to_group
from nexus_mock.overflow import overflow_body
from routing.core.context_shift_policy import ContextShiftPolicy

FIXTURES = Path(__file__).parent.parent / "fixtures" / "context_overflow"
RECORDED = sorted(FIXTURES.glob("*.json"))


def _fixture(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_each_recorded_overflow_is_recognised_with_its_numbers(path: Path) -> None:
    recorded = _fixture(path)
    body = json.dumps(recorded["body"]).encode()
    overflow = recognise(recorded["kind"], recorded["status"], body)
    assert overflow is not None
    assert overflow.n_ctx == recorded["n_ctx"]
    assert overflow.n_prompt_tokens == recorded["n_prompt_tokens"]


@pytest.mark.parametrize("kind", ["llamacpp", "ollama", "vllm", "openai"])
def test_the_mock_answers_what_the_real_server_does(kind: str) -> None:
    recorded = _fixture(FIXTURES / f"{kind}.json")
    mocked = json.loads(overflow_body(kind, 9000, 8192, 0))
    real = recorded["body"]
    assert mocked.keys() == real.keys()
    if isinstance(real["error"], dict) if "error" in real else False:
        assert mocked["error"].keys() == real["error"].keys()
    assert recognise(kind, 400, json.dumps(mocked).encode()) is not None


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (400, b'{"error":{"message":"messages: field required","type":"x"}}'),
        (400, b'{"error":"model is required"}'),
        (404, b'{"error":{"code":"context_length_exceeded"}}'),
        (400, b"not json at all"),
        (500, b'{"error":{"message":"CUDA out of memory"}}'),
    ],
)
def test_other_errors_are_not_overflows(status: int, body: bytes) -> None:
    for kind in ("llamacpp", "ollama", "vllm", "openai"):
        assert recognise(kind, status, body) is None


def _chat(turns: int, words: int = 20) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for index in range(turns):
        role = "user" if index % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"turn {index} " + "w " * words})
    return messages


def test_trim_keeps_system_and_newest_and_starts_with_a_user() -> None:
    messages = _chat(40)
    budget = estimate(messages) // 4
    kept, dropped = trim_messages(messages, budget)
    assert dropped > 0
    assert kept[0] == messages[0]
    assert kept[-1] == messages[-1]
    assert kept[1]["role"] == "user"
    assert estimate(kept) <= budget
    assert kept == [messages[0], *messages[len(messages) - len(kept) + 1 :]]


def test_the_newest_message_is_never_dropped() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "x" * 4000},
    ]
    kept, dropped = trim_messages(messages, 10)
    assert (kept, dropped) == (messages, 0)


def test_a_tool_call_goes_with_its_results() -> None:
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
    }
    result = {"role": "tool", "tool_call_id": "c1", "content": "r " * 50}
    messages = [
        {"role": "user", "content": "q " * 50},
        call,
        result,
        {"role": "user", "content": "next " * 50},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "last"},
    ]
    budget = estimate(messages) - estimate(messages[0]) - 1
    kept, _ = trim_messages(messages, budget)
    assert call not in kept and result not in kept
    assert kept[0]["role"] == "user"


def test_anthropic_tool_use_and_result_blocks_go_together() -> None:
    messages = [
        {"role": "user", "content": "q " * 50},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}],
        },
        {"role": "user", "content": "last"},
    ]
    kept, dropped = trim_messages(messages, estimate(messages[-1]))
    assert kept == [messages[-1]] and dropped == 3


def test_retry_one_keeps_the_tools_and_retry_two_drops_them() -> None:
    tools = [{"type": "function", "function": {"name": "f", "description": "d " * 400}}]
    payload = {
        "model": "m",
        "messages": _chat(9),
        "tools": tools,
        "tool_choice": "auto",
    }
    settings = ContextShiftPolicy()
    first = shrink("chat", payload, None, 300, 1, settings)
    assert first is not None
    assert first[0]["tools"] == tools and first[1] > 0 and not first[2]
    second = shrink("chat", first[0], None, 300, 2, settings)
    assert second is not None
    assert "tools" not in second[0] and "tool_choice" not in second[0] and second[2]


def test_nothing_to_drop_is_none() -> None:
    payload = {"model": "m", "messages": [{"role": "user", "content": "x" * 9000}]}
    assert shrink("chat", payload, None, 100, 1, ContextShiftPolicy()) is None


def test_a_limit_is_forgotten_when_the_context_changes() -> None:
    limits = ContextLimits()
    limits.remember("b", "m", 500, 4096, 4096)
    assert limits.limit("b", "m", 4096) == 500
    assert limits.limit("b", "m", 8192) is None
    assert limits.limit("b", "m", 4096) is None
    limits.remember("b", "m", 500, None, 65536)  # too large to pre-trim
    assert limits.limit("b", "m", None) is None


def test_a_responses_input_is_trimmed_with_its_function_call_pairs() -> None:
    items: list[Any] = [
        {"role": "user", "content": "old " * 100},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "r " * 100},
        {"role": "user", "content": "newest"},
    ]
    payload = {"model": "m", "instructions": "be terse", "input": items}
    shrunk = shrink("responses", payload, None, 40, 1, ContextShiftPolicy())
    assert shrunk is not None
    assert shrunk[0]["input"] == [items[-1]] and shrunk[1] == 3
    assert shrunk[0]["instructions"] == "be terse"


def test_the_servers_numbers_set_the_target() -> None:
    payload = {"model": "m", "messages": _chat(40)}
    overflow = recognise(
        "llamacpp",
        400,
        overflow_body("llamacpp", 2000, 1000),  # twice the context
    )
    assert overflow is not None and overflow.scale() == 0.5
    shrunk = shrink("chat", payload, overflow, None, 1, ContextShiftPolicy())
    assert shrunk is not None
    before, after = estimate(payload["messages"]), estimate(shrunk[0]["messages"])
    assert 0.3 * before < after <= 0.5 * before


async def test_a_learned_limit_reaches_the_other_processes() -> None:
    """Through the channel layer (Redis in production): what one process
    learns, the others' gateways apply without announcing it again."""
    here, there = SharedContextLimits(), SharedContextLimits()
    listener = asyncio.create_task(listen_to_group(CONTEXT_GROUP, there.on_message))
    try:
        deadline = time.monotonic() + 5
        while there.limit("gpu-1", "small", 4096) is None:
            assert time.monotonic() < deadline, "the limit never arrived"
            here.learned("gpu-1", "small", 900, 4096, 4096)  # until it listens
            await asyncio.sleep(0.05)
        assert there.n_ctx("gpu-1", "small") == 4096
        assert there._background == set()  # not announced again
        there.on_message({"type": "context.limit", "origin": "x", "limit": "big"})
        here.remember("gpu-1", "large", 90_000, 131_072, 131_072)
        assert here.limit("gpu-1", "large", 131_072) is None  # too large to keep
    finally:
        listener.cancel()
        await asyncio.gather(listener, *here._background, return_exceptions=True)
