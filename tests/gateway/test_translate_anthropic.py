"""The Anthropic translators, pure: examples, errors and round-trip properties.

Streams are checked by feeding what the translators write into the anthropic
SDK's own accumulator (``accumulate_event``), the code a client runs.
"""

from __future__ import annotations

import inspect
import itertools
import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocols.anthropic import (
    MessageStreamReader,
    MessageStreamWriter,
    canonical_to_message,
    canonical_to_messages,
    estimate_input_tokens,
    message_to_canonical,
    messages_to_canonical,
)
from gateway.protocols.base import StreamFailed, TranslationError, dumps

pytestmark = pytest.mark.mode_independent

PNG = "iVBORw0KGgo="


def _sse_events(chunks: list[bytes]) -> list[dict[str, Any]]:
    """Parse written SSE bytes; each event's name must match its type."""
    events = []
    for raw in b"".join(chunks).split(b"\n\n"):
        if not raw:
            continue
        name, data = raw.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        event = json.loads(data[6:])
        assert event["type"] == name[7:].decode()
        events.append(event)
    return events


def _accumulate(events: list[dict[str, Any]]) -> dict[str, Any]:
    snapshot = None
    # anthropic 2.x's accumulator keeps partial tool JSON in a caller's dict.
    wants = "json_bufs" in inspect.signature(accumulate_event).parameters
    extra: dict[str, Any] = {"json_bufs": {}} if wants else {}
    for event in events:
        if event["type"] in ("ping", "error"):
            continue
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, **extra)
    assert snapshot is not None
    return snapshot.to_dict(exclude_none=True)


# --- inbound: a Messages request as a chat request -------------------------


def test_a_full_messages_request_becomes_a_chat_request() -> None:
    body = {
        "model": "claude-x",
        "max_tokens": 100,
        "system": "Be brief.",
        "temperature": 0.5,
        "stop_sequences": ["END"],
        "metadata": {"user_id": "u-1"},
        "tools": [
            {
                "name": "weather",
                "description": "Weather for a city",
                "input_schema": {"type": "object", "properties": {"city": {}}},
            }
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": PNG,
                        },
                    },
                    {
                        "type": "image",
                        "source": {"type": "url", "url": "https://x.test/a.jpg"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "weather",
                        "input": {"city": "Oslo"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3C"},
                    {"type": "text", "text": "And now?"},
                ],
            },
        ],
    }
    assert messages_to_canonical(body) == {
        "model": "claude-x",
        "max_tokens": 100,
        "temperature": 0.5,
        "stop": ["END"],
        "user": "u-1",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "Weather for a city",
                    "parameters": {"type": "object", "properties": {"city": {}}},
                },
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {
                        "type": "image_url",
                        "image_url": {"url": f"data:image/png;base64,{PNG}"},
                    },
                    {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Checking."}],
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {
                            "name": "weather",
                            "arguments": '{"city": "Oslo"}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "-3C"},
            {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
        ],
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 0, "messages": [{"role": "user"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "x", "content": ""}]},
            "messages.0.role",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "text"}]}],
            },
            "messages.0.content.0.text",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "t"}],
            },
            "tools.0.input_schema",
        ),
    ],
)
def test_malformed_requests_are_refused_naming_the_field(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(TranslationError) as raised:
        messages_to_canonical(body)
    assert raised.value.status == 400
    assert raised.value.param == param
    assert param in raised.value.message


def test_documents_are_refused_for_translation_but_kept_out_for_routing() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "document", "source": {"type": "text", "data": "d"}},
                    {"type": "text", "text": "Summarise"},
                ],
            }
        ],
    }
    with pytest.raises(TranslationError) as raised:
        messages_to_canonical(body)
    assert raised.value.code == "unsupported_content"
    lenient = messages_to_canonical(body, skip_unsupported=True)
    assert lenient["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Summarise"}]}
    ]


def test_count_tokens_estimate_counts_text_tools_and_images() -> None:
    canonical = messages_to_canonical(
        {
            "model": "m",
            "max_tokens": 5,
            "system": "abcd" * 10,
            "messages": [{"role": "user", "content": "efgh" * 10}],
        }
    )
    assert estimate_input_tokens(canonical) == 20
    with_image = messages_to_canonical(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "url", "url": "https://x.test/i.png"},
                        }
                    ],
                }
            ],
        }
    )
    assert estimate_input_tokens(with_image) == 1600


# --- inbound: answers --------------------------------------------------------


def test_a_chat_completion_becomes_a_message() -> None:
    reply = {
        "id": "chatcmpl-abc",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Let me look.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "w", "arguments": '{"city":"Oslo"}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 5,
            "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    }
    assert canonical_to_message(reply, "claude-x") == {
        "id": "msg_abc",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [
            {"type": "text", "text": "Let me look."},
            {
                "type": "tool_use",
                "id": "call_1",
                "name": "w",
                "input": {"city": "Oslo"},
            },
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 2},
    }


def test_the_stream_writer_emits_every_anthropic_event_in_order() -> None:
    writer = MessageStreamWriter("claude-x")
    chunks = [
        {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_9",
                                "type": "function",
                                "function": {"name": "w", "arguments": '{"ci'},
                            }
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "function": {"arguments": 'ty":1}'}}
                        ]
                    },
                    "finish_reason": "tool_calls",
                }
            ]
        },
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}},
    ]
    out = [b for chunk in chunks for b in writer.feed(chunk)] + writer.finish()
    events = _sse_events(out)
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["id"] == "msg_1"
    assert events[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"input_tokens": 7, "output_tokens": 3},
    }
    message = _accumulate(events)
    assert message["content"] == [
        {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "call_9", "name": "w", "input": {"city": 1}},
    ]
    assert message["usage"] == {"input_tokens": 7, "output_tokens": 3}


def test_a_broken_stream_ends_with_an_anthropic_error_event() -> None:
    writer = MessageStreamWriter("m")
    writer.feed({"choices": [{"index": 0, "delta": {"content": "a"}}]})
    (event,) = _sse_events(writer.fail("backend gone"))
    assert event == {
        "type": "error",
        "error": {"type": "api_error", "message": "backend gone"},
    }


# --- outbound: a chat request as a Messages request --------------------------


def test_a_chat_request_becomes_a_messages_request() -> None:
    request = {
        "model": "claude-x",
        "temperature": 1.7,
        "stop": "END",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "w", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "-3C"},
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [{"type": "function", "function": {"name": "w"}}],
        "tool_choice": "auto",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert canonical_to_messages(request) == {
        "model": "claude-x",
        "max_tokens": 4096,
        "system": "Be brief.",
        "temperature": 1.0,
        "stop_sequences": ["END"],
        "stream": True,
        "tools": [{"name": "w", "input_schema": {"type": "object", "properties": {}}}],
        "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "call_1",
                        "name": "w",
                        "input": {"city": "Oslo"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "-3C"},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
    }


@pytest.mark.parametrize(
    "change",
    [
        {"n": 2},
        {"response_format": {"type": "json_object"}},
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "function": {"name": "f", "arguments": "[1]"}}
                    ],
                }
            ]
        },
    ],
)
def test_what_anthropic_cannot_take_is_a_400(change: dict[str, Any]) -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "x"}], **change}
    with pytest.raises(TranslationError) as raised:
        canonical_to_messages(request)
    assert raised.value.status == 400


def test_the_stream_reader_fails_on_an_error_event_or_a_cut() -> None:
    reader = MessageStreamReader()
    reader.feed({"type": "message_start", "message": {"id": "msg_1", "usage": {}}})
    with pytest.raises(StreamFailed, match="Overloaded"):
        reader.feed(
            {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "Overloaded"},
            }
        )
    with pytest.raises(StreamFailed, match="message_stop"):
        MessageStreamReader().finish()


def test_json_that_orjson_refuses_is_still_written() -> None:
    value = {"big": 2**70, "lone": "\ud800", "text": "é"}
    assert json.loads(dumps(value)) == value
    assert dumps({"text": "é"}) == '{"text":"é"}'.encode()


# --- round-trip properties ---------------------------------------------------

_text = st.text(max_size=20)
_nonempty = st.text(min_size=1, max_size=20)
_name = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)
_scalar = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
_json = (
    _scalar
    | st.lists(_scalar, max_size=3)
    | st.dictionaries(st.text(max_size=5), _scalar, max_size=3)
)
_objects = st.dictionaries(st.text(max_size=6), _json, max_size=3)
_image = st.one_of(
    st.builds(
        lambda data: {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": data},
        },
        st.from_regex(r"[A-Za-z0-9+/]{0,12}", fullmatch=True),
    ),
    st.builds(
        lambda path: {"type": "image", "source": {"type": "url", "url": path}},
        st.from_regex(r"https://x\.test/[a-z]{1,8}\.png", fullmatch=True),
    ),
)
_text_block = st.builds(lambda t: {"type": "text", "text": t}, _nonempty)
_tool_use = st.builds(
    lambda i, n, a: {"type": "tool_use", "id": f"toolu_{i}", "name": n, "input": a},
    st.integers(0, 999),
    _name,
    _objects,
)
_tool_result = st.builds(
    lambda i, c: {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": c},
    st.integers(0, 999),
    _text | st.lists(_text_block, max_size=2),
)
_user = st.builds(
    lambda results, rest: {"role": "user", "content": results + rest},
    st.lists(_tool_result, max_size=2),
    st.lists(_text_block | _image, min_size=1, max_size=3),
) | st.builds(lambda t: {"role": "user", "content": t}, _nonempty)
_assistant = st.builds(
    lambda texts, calls: {"role": "assistant", "content": texts + calls},
    st.lists(_text_block, max_size=2),
    st.lists(_tool_use, max_size=2),
).filter(lambda m: m["content"]) | st.builds(
    lambda t: {"role": "assistant", "content": t}, _nonempty
)
_tools = st.lists(
    st.builds(
        lambda n, d: {
            "name": n,
            "description": d,
            "input_schema": {"type": "object", "properties": {}},
        },
        _name,
        _nonempty,
    ),
    min_size=1,
    max_size=2,
)
_requests = st.fixed_dictionaries(
    {
        "model": _name,
        "max_tokens": st.integers(1, 10_000),
        "messages": st.lists(_user | _assistant, min_size=1, max_size=5),
    },
    optional={
        "system": _nonempty | st.lists(_text_block, min_size=1, max_size=2),
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0, 1),
        "stop_sequences": st.lists(_nonempty, min_size=1, max_size=2),
        "stream": st.booleans(),
        "tools": _tools,
        "tool_choice": st.sampled_from(
            [{"type": "auto"}, {"type": "any"}, {"type": "none"}]
        ),
        "metadata": st.builds(lambda u: {"user_id": u}, _nonempty),
    },
)


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    out = []
    for block in content:
        if block["type"] == "tool_result" and isinstance(block["content"], list):
            block = {**block, "content": block["content"]}
        out.append(block)
    return out


def _normal(body: dict[str, Any]) -> dict[str, Any]:
    """Turns as block lists, consecutive turns of one role merged."""
    turns: list[dict[str, Any]] = []
    for message in body["messages"]:
        blocks = _blocks(message["content"])
        if turns and turns[-1]["role"] == message["role"]:
            turns[-1]["content"] += blocks
        else:
            turns.append({"role": message["role"], "content": blocks})
    system = body.get("system")
    if isinstance(system, list) and len(system) == 1:
        system = system[0]["text"]
    normal = {**body, "messages": turns, "system": system}
    if not normal.get("stream"):
        normal.pop("stream", None)
    return normal


@settings(max_examples=150, deadline=None)
@given(_requests)
def test_messages_requests_survive_the_round_trip(body: dict[str, Any]) -> None:
    back = canonical_to_messages(messages_to_canonical(body))
    assert _normal(back) == _normal(body)


_finish = st.sampled_from(["stop", "length", "tool_calls"])
_calls = st.lists(
    st.builds(
        lambda i, n, a: {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": n, "arguments": json.dumps(a)},
        },
        st.integers(0, 999),
        _name,
        _objects,
    ),
    max_size=3,
    unique_by=lambda c: c["id"],
)
_replies = st.builds(
    lambda text, calls, finish, prompt, completion: {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, **calls},
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    },
    _text,
    _calls.map(lambda calls: {"tool_calls": calls} if calls else {}),
    _finish,
    st.integers(0, 10_000),
    st.integers(0, 10_000),
)


def _canonical_normal(reply: dict[str, Any]) -> dict[str, Any]:
    message = reply["choices"][0]["message"]
    calls = [
        {
            **c,
            "function": {
                **c["function"],
                "arguments": json.loads(c["function"]["arguments"]),
            },
        }
        for c in message.get("tool_calls", [])
    ]
    return {
        "text": message["content"] or "",
        "calls": calls,
        "finish": reply["choices"][0]["finish_reason"],
        "usage": reply["usage"],
    }


@settings(max_examples=150, deadline=None)
@given(_replies)
def test_chat_replies_survive_the_round_trip_through_a_message(
    reply: dict[str, Any],
) -> None:
    back = message_to_canonical(canonical_to_message(reply, "m"))
    assert _canonical_normal(back) == _canonical_normal(reply)


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a]


def _chunks_of(reply: dict[str, Any], cuts: list[int]) -> list[dict[str, Any]]:
    """Stream a chat reply as chunks, its strings cut at the given offsets."""
    message = reply["choices"][0]["message"]

    def pieces(text: str) -> list[str]:
        return _pieces(text, cuts)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": "chatcmpl-s",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": piece}) for piece in pieces(message["content"] or "")]
    for index, call in enumerate(message.get("tool_calls", [])):
        fn = call["function"]
        first = {"index": index, "id": call["id"], "type": "function"}
        out.append(
            chunk(
                {
                    "tool_calls": [
                        {**first, "function": {"name": fn["name"], "arguments": ""}}
                    ]
                }
            )
        )
        for piece in pieces(fn["arguments"]):
            out.append(
                chunk(
                    {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
                )
            )
    out.append(chunk({}, reply["choices"][0]["finish_reason"]))
    out.append({"id": "chatcmpl-s", "choices": [], "usage": reply["usage"]})
    return out


@settings(max_examples=100, deadline=None)
@given(_replies, st.lists(st.integers(0, 50), max_size=4))
def test_a_streamed_reply_accumulates_to_the_same_message(
    reply: dict[str, Any], cuts: list[int]
) -> None:
    writer = MessageStreamWriter("m")
    out = [b for chunk in _chunks_of(reply, cuts) for b in writer.feed(chunk)]
    streamed = _accumulate(_sse_events(out + writer.finish()))
    whole = canonical_to_message(reply, "m")
    assert streamed["content"] == whole["content"]
    assert streamed["stop_reason"] == whole["stop_reason"]
    assert streamed["usage"] == whole["usage"]


def _events_of(message: dict[str, Any], cuts: list[int]) -> list[dict[str, Any]]:
    """Stream a Message as Anthropic does, its strings cut at the offsets."""

    def pieces(text: str) -> list[str]:
        return _pieces(text, cuts)

    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "usage": {**usage, "output_tokens": 1},
    }
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": start},
        {"type": "ping"},
    ]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            events.append(
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {"type": "text", "text": ""},
                }
            )
            for piece in pieces(block["text"]):
                events.append(
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "text_delta", "text": piece},
                    }
                )
        else:
            events.append(
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {**block, "input": {}},
                }
            )
            for piece in pieces(json.dumps(block["input"])):
                events.append(
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": piece},
                    }
                )
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": usage["output_tokens"]},
        }
    )
    events.append({"type": "message_stop"})
    return events


@settings(max_examples=100, deadline=None)
@given(_replies, st.lists(st.integers(0, 50), max_size=4))
def test_an_anthropic_stream_reads_as_the_same_chat_reply(
    reply: dict[str, Any], cuts: list[int]
) -> None:
    message = canonical_to_message(reply, "m")
    reader = MessageStreamReader()
    chunks = [c for event in _events_of(message, cuts) for c in reader.feed(event)]
    chunks += reader.finish()
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for c in chunks:
        for choice in c["choices"]:
            finish = choice["finish_reason"] or finish
            for call in choice["delta"].get("tool_calls", []):
                entry = calls.setdefault(
                    call["index"], {"id": call.get("id"), "name": "", "arguments": ""}
                )
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
    whole = message_to_canonical(message)
    expected = whole["choices"][0]["message"]
    assert text == (expected["content"] or "")
    assert [
        {"id": c["id"], "name": c["name"], "arguments": json.loads(c["arguments"])}
        for c in calls.values()
    ] == [
        {
            "id": c["id"],
            "name": c["function"]["name"],
            "arguments": json.loads(c["function"]["arguments"]),
        }
        for c in expected.get("tool_calls", [])
    ]
    assert finish == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]
