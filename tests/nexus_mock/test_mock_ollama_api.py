"""The mock's native Ollama API and scripted tool calls, driven by official clients."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest

from nexus_mock import MockBackendProcess, spawn_mock_backend

pytestmark = pytest.mark.mode_independent

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]


@pytest.fixture(scope="module")
def process() -> Iterator[MockBackendProcess]:
    process = spawn_mock_backend(
        "--kind", "ollama", "--name", "olla", "--models", "llama3:8b,nomic-embed"
    )
    yield process
    process.stop()


@pytest.fixture
def http(process: MockBackendProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=process.base_url, timeout=10) as client:
        assert client.post("/_mock/reset").status_code == 200
        yield client


@pytest.fixture
def client(process: MockBackendProcess, http: httpx.Client) -> ollama.Client:
    return ollama.Client(host=process.base_url, timeout=10)


def configure(http: httpx.Client, **knobs: Any) -> None:
    response = http.post("/_mock/config", json=knobs)
    assert response.status_code == 200, response.text


def test_chat_answers_whole_with_ollamas_usage_fields(client: ollama.Client) -> None:
    reply = client.chat(
        model="llama3:8b",
        messages=[
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "why is the sky blue"},
        ],
        stream=False,
    )
    assert reply.message.content == "[olla/llama3:8b] echo: why is the sky blue"
    assert (reply.done, reply.done_reason) == (True, "stop")
    # Words: 2 + 5 in the prompt, 7 in the reply.
    assert (reply.prompt_eval_count, reply.eval_count) == (7, 7)
    assert reply.total_duration and reply.eval_duration


def test_chat_streams_ndjson_whose_pieces_join_to_the_reply(
    client: ollama.Client, http: httpx.Client
) -> None:
    configure(http, chunks=3)
    parts = list(
        client.chat(
            model="llama3:8b",
            messages=[{"role": "user", "content": "hello there"}],
            stream=True,
        )
    )
    assert len(parts) == 4
    assert [p.done for p in parts] == [False, False, False, True]
    text = "".join(p.message.content or "" for p in parts)
    assert text == "[olla/llama3:8b] echo: hello there"
    assert (parts[-1].prompt_eval_count, parts[-1].eval_count) == (2, 4)
    with http.stream(
        "POST", "/api/chat", json={"model": "llama3:8b", "messages": [{"role": "user"}]}
    ) as response:
        assert response.headers["content-type"] == "application/x-ndjson"


def test_generate_whole_and_streamed_and_a_load_request(
    client: ollama.Client,
) -> None:
    whole = client.generate(model="llama3:8b", prompt="tell me", stream=False)
    assert whole.response == "[olla/llama3:8b] echo: tell me"
    assert (whole.prompt_eval_count, whole.eval_count) == (2, 4)
    streamed = list(client.generate(model="llama3:8b", prompt="tell me", stream=True))
    assert "".join(p.response or "" for p in streamed) == whole.response
    loaded = client.generate(model="llama3:8b", prompt="", stream=False)
    assert (loaded.done, loaded.done_reason) == (True, "load")


def test_num_predict_cuts_the_reply(client: ollama.Client) -> None:
    reply = client.chat(
        model="llama3:8b",
        messages=[{"role": "user", "content": "one two three"}],
        options={"num_predict": 2},
        stream=False,
    )
    assert (reply.message.content, reply.done_reason) == (
        "[olla/llama3:8b] echo:",
        "length",
    )


def test_embed_and_legacy_embeddings(client: ollama.Client, http: httpx.Client) -> None:
    configure(http, embedding_dim=6)
    embed = client.embed(model="nomic-embed", input=["a b", "c"])
    assert [len(v) for v in embed.embeddings] == [6, 6]
    assert embed.prompt_eval_count == 3
    legacy = client.embeddings(model="nomic-embed", prompt="a b")
    assert list(legacy.embedding) == list(embed.embeddings[0])
    assert (
        len(client.embed(model="nomic-embed", input="x", dimensions=3).embeddings[0])
        == 3
    )


def test_errors_come_in_ollamas_shape(
    client: ollama.Client, http: httpx.Client
) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 404
    assert caught.value.error == 'model "gpt-9" not found, try pulling it first'
    bad = http.post("/api/generate", content=b"{")
    assert (bad.status_code, bad.json()) == (
        400,
        {"error": "invalid character in request body"},
    )
    configure(http, error_rate=1.0, fail_status=503)
    failed = http.post(
        "/api/chat",
        json={"model": "llama3:8b", "messages": [{"role": "user", "content": "x"}]},
    )
    assert failed.status_code == 503
    assert set(failed.json()) == {"error"}


def test_a_cut_stream_ends_without_the_done_line(
    client: ollama.Client, http: httpx.Client
) -> None:
    configure(http, chunks=4, drop_after_chunks=2)
    parts = client.chat(
        model="llama3:8b", messages=[{"role": "user", "content": "x"}], stream=True
    )
    received = [next(parts), next(parts)]
    with pytest.raises(httpx.HTTPError):
        next(parts)
    assert not any(p.done for p in received)


def test_key_is_required_when_set(
    process: MockBackendProcess, http: httpx.Client
) -> None:
    configure(http, api_key="sekret")
    anonymous = http.post("/api/chat", json={"model": "llama3:8b"})
    assert (anonymous.status_code, anonymous.json()) == (401, {"error": "unauthorized"})
    keyed = ollama.Client(
        host=process.base_url, headers={"Authorization": "Bearer sekret"}
    )
    assert (
        keyed.chat(model="llama3:8b", messages=[], stream=False).done_reason == "load"
    )


def test_scripted_tool_calls_in_ollamas_shape(client: ollama.Client) -> None:
    ask = [{"role": "user", "content": "Paris"}]
    reply = client.chat(model="llama3:8b", messages=ask, tools=TOOLS, stream=False)
    assert reply.message.tool_calls is not None
    call = reply.message.tool_calls[0].function
    # Arguments made from the schema: a string property gets the user's words.
    assert (call.name, dict(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert reply.eval_count == 1  # the words of the arguments' JSON
    streamed = list(
        client.chat(model="llama3:8b", messages=ask, tools=TOOLS, stream=True)
    )
    calls = [c for p in streamed for c in (p.message.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert streamed[-1].done and streamed[-1].eval_count == 1
    # Without tools offered, or after the tool answered, the mock talks.
    plain = client.chat(model="llama3:8b", messages=ask, stream=False)
    assert plain.message.tool_calls is None
    answered = client.chat(
        model="llama3:8b",
        messages=[
            *ask,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": reply.message.tool_calls,
            },
            {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
        ],
        tools=TOOLS,
        stream=False,
    )
    assert answered.message.content == "[olla/llama3:8b] echo: tool result: sunny"


def test_the_tool_arguments_knob_scripts_the_call(
    client: ollama.Client, http: httpx.Client
) -> None:
    configure(http, tool_arguments={"city": "Oslo", "days": 3})
    reply = client.chat(
        model="llama3:8b",
        messages=[{"role": "user", "content": "x"}],
        tools=TOOLS,
        stream=False,
    )
    assert reply.message.tool_calls is not None
    assert dict(reply.message.tool_calls[0].function.arguments) == {
        "city": "Oslo",
        "days": 3,
    }
