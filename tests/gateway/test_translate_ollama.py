"""The Ollama translator, checked against the ollama client's own types."""

from __future__ import annotations

import itertools
import json
from typing import Any

import ollama
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocols.base import TranslationError
from gateway.protocols.ollama import (
    NativeStreamUsage,
    OllamaStreamTranslator,
    chat_reply,
    embed_reply,
    embeddings_reply,
    error_body,
    generate_reply,
    load_reply,
    parse_chat,
    parse_embed,
    parse_embeddings,
    parse_generate,
    usage_of_native,
)

pytestmark = pytest.mark.mode_independent

USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
PNG = "iVBORw0KGgoAAAANSUhEUg=="
JPEG = "/9j/4AAQSkZJRg=="


def reply_of(
    text: str, calls: list[tuple[str, str]], finish: str = "stop"
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for i, (name, args) in enumerate(calls)
        ]
    return {
        "id": "chatcmpl-1",
        "model": "served",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": USAGE,
    }


def chunks_of(
    pieces: list[str], calls: list[tuple[str, list[str]]], finish: str
) -> list[dict[str, Any]]:
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    for index, (name, arg_pieces) in enumerate(calls):
        first = {"index": index, "id": f"c{index}", "function": {"name": name}}
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [first]}}]})
        for piece in arg_pieces:
            call = {"index": index, "function": {"arguments": piece}}
            chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({"choices": [], "usage": USAGE})
    return chunks


def run_stream(path: str, chunks: list[dict[str, Any]], *, fail: str = "") -> bytes:
    ticks = itertools.count(1_000, 1_000)
    translator = OllamaStreamTranslator(
        path,  # type: ignore[arg-type]
        "llama3:8b",
        clock=lambda: 1_700_000_000.25,
        ticks=lambda: next(ticks),
    )
    out: list[bytes] = []
    for chunk in chunks:
        out += translator.feed(chunk)
    out += translator.fail(fail) if fail else translator.finish()
    return b"".join(out)


# Requests


def test_chat_maps_messages_images_tools_format_and_options():
    request = parse_chat(
        {
            "model": "llama3:8b",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is this?", "images": [PNG, JPEG]},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": "look", "arguments": {"x": 1}}},
                        {"function": {"name": "zoom", "arguments": {}}},
                    ],
                },
                {"role": "tool", "tool_name": "zoom", "content": "2x"},
                {"role": "tool", "tool_name": "look", "content": "a cat"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "look", "parameters": {"type": "object"}},
                }
            ],
            "format": {"type": "object"},
            "options": {
                "temperature": 0.3,
                "top_p": 0.8,
                "seed": 42,
                "stop": ["END"],
                "num_predict": 100,
                "num_ctx": 4096,
                "top_k": 20,
            },
            "keep_alive": "5m",
            "think": True,
        }
    )
    assert request.stream is True  # Ollama streams unless told not to
    assert request.endpoint == "chat" and not request.load_only
    body = request.canonical
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {
                    "type": "image_url",
                    "image_url": {"url": f"data:image/png;base64,{PNG}"},
                },
                {
                    "type": "image_url",
                    "image_url": {"url": f"data:image/jpeg;base64,{JPEG}"},
                },
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "look", "arguments": '{"x":1}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "zoom", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "2x"},
        {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
    ]
    assert body["tools"][0]["function"]["name"] == "look"
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": {"type": "object"}},
    }
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    for key, value in [
        ("temperature", 0.3),
        ("top_p", 0.8),
        ("seed", 42),
        ("stop", ["END"]),
        ("max_tokens", 100),
    ]:
        assert body[key] == value
    assert not {"num_ctx", "top_k", "keep_alive", "think", "options"} & set(body)


def test_generate_is_a_chat_of_system_and_prompt_and_flags_native_only_fields():
    request = parse_generate(
        {
            "model": "m",
            "prompt": "Why is the sky blue?",
            "system": "Answer in one line.",
            "format": "json",
            "stream": False,
            "options": {"num_predict": -1},
            "suffix": "return x",
            "raw": True,
        }
    )
    assert request.stream is False
    assert request.canonical == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
        "response_format": {"type": "json_object"},
    }
    assert request.native_only == ("suffix", "raw")


def test_empty_requests_only_load_the_model():
    assert parse_chat({"model": "m", "messages": []}).load_only
    assert parse_chat({"model": "m"}).load_only
    assert parse_generate({"model": "m"}).load_only
    assert parse_embed({"model": "m", "input": []}).load_only
    assert parse_embeddings({"model": "m"}).load_only
    chat = ollama.ChatResponse(**load_reply("/api/chat", "m", created_at="t"))
    assert chat.done and chat.done_reason == "load"
    generated = ollama.GenerateResponse(
        **load_reply("/api/generate", "m", created_at="t")
    )
    assert generated.done_reason == "load"
    assert ollama.EmbedResponse(**load_reply("/api/embed", "m", created_at="t"))


def test_embed_and_legacy_embeddings_become_an_embeddings_request():
    embed = parse_embed({"model": "e", "input": ["a", "b"], "dimensions": 4})
    assert embed.endpoint == "embeddings" and embed.stream is False
    assert embed.canonical == {"model": "e", "input": ["a", "b"], "dimensions": 4}
    assert parse_embed({"model": "e", "input": "a"}).canonical["input"] == ["a"]
    legacy = parse_embeddings({"model": "e", "prompt": "hello"})
    assert legacy.canonical == {"model": "e", "input": ["hello"]}


@pytest.mark.parametrize(
    ("parse", "body", "fragment"),
    [
        (parse_chat, {"messages": []}, "model is required"),
        (parse_chat, {"model": "m", "messages": "hi"}, "messages must be an array"),
        (parse_chat, {"model": "m", "stream": "yes"}, "stream must be a boolean"),
        (parse_chat, {"model": "m", "options": []}, "options must be an object"),
        (
            parse_chat,
            {"model": "m", "options": {"temperature": "hot"}},
            "options.temperature must be a number",
        ),
        (
            parse_chat,
            {"model": "m", "options": {"num_ctx": 1.5}},
            "options.num_ctx must be an integer",
        ),
        (parse_chat, {"model": "m", "format": "xml"}, "format must be"),
        (
            parse_chat,
            {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
            "role must be",
        ),
        (
            parse_chat,
            {"model": "m", "messages": [{"role": "user", "images": [1]}]},
            "base64",
        ),
        (parse_generate, {"model": "m", "prompt": 5}, "prompt must be a string"),
        (parse_embed, {"model": "m", "input": [1]}, "input must be"),
    ],
)
def test_malformed_requests_are_400s_with_ollamas_wording(parse, body, fragment):
    with pytest.raises(TranslationError) as caught:
        parse(body)
    assert caught.value.status == 400
    assert fragment in caught.value.message


# Replies


def test_chat_reply_is_what_the_ollama_client_reads():
    reply = reply_of("Hello", [("look", '{"x": 1}')], "tool_calls")
    answer = ollama.ChatResponse(
        **chat_reply(reply, "llama3:8b", created_at="t", total_ns=5_000)
    )
    assert answer.model == "llama3:8b"
    assert answer.message.content == "Hello"
    assert answer.message.tool_calls is not None
    call = answer.message.tool_calls[0].function
    assert (call.name, dict(call.arguments)) == ("look", {"x": 1})
    assert (answer.done, answer.done_reason) == (True, "stop")
    assert (answer.prompt_eval_count, answer.eval_count) == (7, 5)
    assert answer.total_duration == 5_000


def test_generate_reply_and_a_length_cut():
    answer = ollama.GenerateResponse(
        **generate_reply(reply_of("Hel", [], "length"), "m", created_at="t", total_ns=1)
    )
    assert (answer.response, answer.done_reason) == ("Hel", "length")


def test_arguments_that_are_not_an_object_stay_visible():
    reply = reply_of("", [("f", "not json")], "tool_calls")
    answer = chat_reply(reply, "m", created_at="t", total_ns=1)
    arguments = answer["message"]["tool_calls"][0]["function"]["arguments"]
    assert arguments == {"_arguments": "not json"}


def test_embed_replies_in_index_order_with_the_prompt_count():
    reply = {
        "data": [
            {"index": 1, "embedding": [0.0, 1.0]},
            {"index": 0, "embedding": [1.0, 0.0]},
        ],
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }
    embed = ollama.EmbedResponse(**embed_reply(reply, "e", total_ns=9))
    assert [list(v) for v in embed.embeddings] == [[1.0, 0.0], [0.0, 1.0]]
    assert embed.prompt_eval_count == 3
    legacy = ollama.EmbeddingsResponse(**embeddings_reply(reply))
    assert list(legacy.embedding) == [1.0, 0.0]


def test_errors_are_ollamas_shape():
    assert json.loads(error_body('model "x" not found')) == {
        "error": 'model "x" not found'
    }


# Streams


def test_chat_stream_is_ndjson_with_usage_and_durations_on_the_last_line():
    raw = run_stream(
        "/api/chat", chunks_of(["Hel", "lo"], [("f", ['{"a"', ":1}"])], "tool_calls")
    )
    lines = [json.loads(line) for line in raw.splitlines()]
    answers = [ollama.ChatResponse(**line) for line in lines]
    assert [a.message.content for a in answers] == ["Hel", "lo", "", ""]
    assert answers[2].message.tool_calls is not None
    assert dict(answers[2].message.tool_calls[0].function.arguments) == {"a": 1}
    assert [a.done for a in answers] == [False, False, False, True]
    last = lines[-1]
    assert (last["prompt_eval_count"], last["eval_count"]) == (7, 5)
    assert last["done_reason"] == "stop"
    # Ticks are 1000 ns apart: start, first token, ..., end.
    assert last["total_duration"] == (
        last["prompt_eval_duration"] + last["eval_duration"]
    )
    assert last["created_at"] == "2023-11-14T22:13:20.250000Z"


def test_generate_stream_and_a_stream_that_breaks_off():
    raw = run_stream(
        "/api/generate", chunks_of(["a", "b"], [], "stop")[:3], fail="gone"
    )
    lines = raw.splitlines()
    assert [json.loads(line).get("response") for line in lines[:2]] == ["a", "b"]
    assert json.loads(lines[-1]) == {"error": "gone"}


def test_native_usage_comes_from_eval_counts():
    assert usage_of_native({"prompt_eval_count": 3, "eval_count": 4}) == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
    }
    assert usage_of_native({"prompt_eval_count": 2, "embeddings": []}) == {
        "prompt_tokens": 2,
        "completion_tokens": 0,
        "total_tokens": 2,
    }
    assert usage_of_native({"done": True}) is None


# Properties

names = st.from_regex(r"[a-z_]{1,10}", fullmatch=True)
json_objects = st.dictionaries(
    st.text(min_size=1, max_size=6), st.integers() | st.text(max_size=6), max_size=3
)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a]


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(max_size=40),
    calls=st.lists(st.tuples(names, json_objects.map(json.dumps)), max_size=3),
    finish=st.sampled_from(["stop", "length", "tool_calls"]),
    cuts=st.lists(st.integers(min_value=0), max_size=6),
)
def test_streamed_and_whole_chat_replies_agree(text, calls, finish, cuts):
    whole = chat_reply(
        reply_of(text, calls, finish), "llama3:8b", created_at="t", total_ns=1
    )
    pieces = [(name, split(args, cuts)) for name, args in calls]
    raw = run_stream("/api/chat", chunks_of(split(text, cuts), pieces, finish))
    lines = [json.loads(line) for line in raw.splitlines()]
    content = "".join(line["message"]["content"] for line in lines)
    streamed_calls = [
        call for line in lines for call in line["message"].get("tool_calls", [])
    ]
    assert content == whole["message"]["content"]
    assert streamed_calls == whole["message"].get("tool_calls", [])
    last = lines[-1]
    for key in ("done", "done_reason", "prompt_eval_count", "eval_count"):
        assert last[key] == whole[key]


def to_native(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The inverse of the chat translation (an oracle for the property)."""
    names_by_id: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in messages:
        native: dict[str, Any] = {"role": message["role"]}
        content = message.get("content")
        if isinstance(content, list):
            native["content"] = "".join(
                p["text"] for p in content if p["type"] == "text"
            )
            native["images"] = [
                p["image_url"]["url"].split(",", 1)[1]
                for p in content
                if p["type"] == "image_url"
            ]
        else:
            native["content"] = content or ""
        if message.get("tool_calls"):
            native["tool_calls"] = []
            for call in message["tool_calls"]:
                names_by_id[call["id"]] = call["function"]["name"]
                native["tool_calls"].append(
                    {
                        "function": {
                            "name": call["function"]["name"],
                            "arguments": json.loads(call["function"]["arguments"]),
                        }
                    }
                )
        if message["role"] == "tool":
            native["tool_name"] = names_by_id[message["tool_call_id"]]
        out.append(native)
    return out


images = st.lists(st.sampled_from([PNG, JPEG]), min_size=1, max_size=2)
user = st.tuples(st.text(min_size=1, max_size=20), images | st.just([])).map(
    lambda t: (
        {"role": "user", "content": t[0], "images": t[1]}
        if t[1]
        else {"role": "user", "content": t[0]}
    )
)
system = st.text(max_size=20).map(lambda t: {"role": "system", "content": t})
turn = st.lists(
    st.tuples(names, json_objects, st.text(max_size=20)), min_size=1, max_size=3
).map(
    lambda calls: [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": n, "arguments": a}} for n, a, _ in calls
            ],
        },
        *({"role": "tool", "tool_name": n, "content": r} for n, _, r in calls),
    ]
)


@settings(max_examples=100, deadline=None)
@given(
    groups=st.lists(
        st.one_of(user.map(lambda m: [m]), system.map(lambda m: [m]), turn),
        min_size=1,
        max_size=5,
    )
)
def test_native_messages_survive_the_round_trip_through_chat_messages(groups):
    messages = [message for group in groups for message in group]
    canonical = parse_chat({"model": "m", "messages": messages}).canonical
    assert to_native(canonical["messages"]) == messages


@settings(max_examples=100, deadline=None)
@given(
    texts=st.lists(st.text(max_size=10), max_size=5),
    counts=st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)),
    cuts=st.lists(st.integers(min_value=0), max_size=8),
)
def test_native_stream_usage_is_read_however_the_bytes_are_split(texts, counts, cuts):
    lines = [
        {"model": "m", "message": {"role": "assistant", "content": t}, "done": False}
        for t in texts
    ]
    lines.append(
        {
            "model": "m",
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "prompt_eval_count": counts[0],
            "eval_count": counts[1],
        }
    )
    raw = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    scanner = NativeStreamUsage()
    points = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    for a, b in itertools.pairwise(points):
        scanner.feed(raw[a:b])
    scanner.close()
    assert scanner.done
    assert scanner.usage == {
        "prompt_tokens": counts[0],
        "completion_tokens": counts[1],
        "total_tokens": sum(counts),
    }
    assert scanner.text_chars == sum(len(t) for t in texts)
