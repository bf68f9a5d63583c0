"""The mock speaks what it claims: Anthropic's Messages API and scripted tool calls,
checked with the official SDKs straight against a mock process."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.conftest import MockBackendProcess, start_mock_backend

pytestmark = pytest.mark.mode_independent

TOOL = {
    "name": "weather",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
        },
    },
}


@pytest.fixture(scope="module")
def claude() -> Iterator[MockBackendProcess]:
    process = start_mock_backend(
        "--kind", "anthropic", "--models", "claude-x", "--api-key", "k-1"
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def chat() -> Iterator[MockBackendProcess]:
    process = start_mock_backend("--models", "llama3:8b", "--name", "o")
    yield process
    process.stop()


@pytest.fixture(autouse=True)
def _reset(claude: MockBackendProcess, chat: MockBackendProcess) -> None:
    for process in (claude, chat):
        httpx.post(f"{process.base_url}/_mock/reset", timeout=5)


def _client(process: MockBackendProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=process.base_url, api_key="k-1", max_retries=0)


def test_messages_plain_and_streamed_agree(claude: MockBackendProcess) -> None:
    client = _client(claude)
    message = client.messages.create(
        model="claude-x",
        max_tokens=50,
        system="sys tem",
        messages=[{"role": "user", "content": "hello there"}],
    )
    assert message.content[0].text == "[mock/claude-x] echo: hello there"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 4)
    with client.messages.stream(
        model="claude-x",
        max_tokens=50,
        system="sys tem",
        messages=[{"role": "user", "content": "hello there"}],
    ) as stream:
        pieces = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert len(pieces) == 4
    assert streamed.content[0].text == message.content[0].text
    assert streamed.usage.output_tokens == 4
    counted = client.messages.count_tokens(
        model="claude-x", messages=[{"role": "user", "content": "a b c"}]
    )
    assert counted.input_tokens == 3


def test_messages_tool_use_then_tool_result(claude: MockBackendProcess) -> None:
    client = _client(claude)
    first = client.messages.create(
        model="claude-x",
        max_tokens=50,
        tools=[TOOL],
        messages=[{"role": "user", "content": "Oslo now"}],
    )
    assert first.stop_reason == "tool_use"
    assert first.content[0].input == {"city": "Oslo now", "days": 2, "metric": True}
    second = client.messages.create(
        model="claude-x",
        max_tokens=50,
        tools=[TOOL],
        messages=[
            {"role": "user", "content": "Oslo now"},
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": first.content[0].id,
                        "content": "sunny",
                    }
                ],
            },
        ],
    )
    assert second.content[0].text == "[mock/claude-x] echo: tool result: sunny"
    none = client.messages.create(
        model="claude-x",
        max_tokens=50,
        tools=[TOOL],
        tool_choice={"type": "none"},
        messages=[{"role": "user", "content": "x"}],
    )
    assert none.content[0].type == "text"


def test_messages_errors_are_anthropics(claude: MockBackendProcess) -> None:
    with pytest.raises(anthropic.NotFoundError):
        _client(claude).messages.create(
            model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url=claude.base_url, api_key="wrong", max_retries=0
        ).messages.create(
            model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    httpx.post(
        f"{claude.base_url}/_mock/config",
        json={"fail_status": 529, "error_rate": 1},
        timeout=5,
    )
    # anthropic 1.x and newer raise their OverloadedError, older ones the base.
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        _client(claude).messages.create(
            model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert overloaded.value.status_code == 529


def test_chat_completions_make_scripted_tool_calls(chat: MockBackendProcess) -> None:
    sdk = openai.OpenAI(base_url=f"{chat.base_url}/v1", api_key="x", max_retries=0)
    tools = [
        {
            "type": "function",
            "function": {"name": "weather", "parameters": TOOL["input_schema"]},
        }
    ]
    reply = sdk.chat.completions.create(
        model="llama3:8b",
        messages=[{"role": "user", "content": "Oslo"}],
        tools=tools,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {
        "city": "Oslo",
        "days": 1,
        "metric": True,
    }
    httpx.post(
        f"{chat.base_url}/_mock/config",
        json={"tool_arguments": {"city": "Rome"}},
        timeout=5,
    )
    chunks = list(
        sdk.chat.completions.create(
            model="llama3:8b",
            messages=[{"role": "user", "content": "Oslo"}],
            tools=tools,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    arguments = "".join(
        c.choices[0].delta.tool_calls[0].function.arguments for c in chunks if c.choices
    )
    assert json.loads(arguments) == {"city": "Rome"}
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage.completion_tokens == 1
    answer = sdk.chat.completions.create(
        model="llama3:8b",
        messages=[
            {"role": "user", "content": "Oslo"},
            {"role": "assistant", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ],
        tools=tools,
    )
    assert answer.choices[0].message.content == "[o/llama3:8b] echo: tool result: sunny"
