"""The Responses API translator, checked against the openai SDK's own types."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.protocols.base import TranslationError
from gateway.protocols.responses import (
    ResponsesStreamTranslator,
    chat_to_response,
    responses_to_chat,
)

pytestmark = pytest.mark.mode_independent

EVENTS = TypeAdapter(ResponseStreamEvent)
USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """Split SSE bytes into events, checking each names its own type."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        kind_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert kind_line == f"event: {event['type']}"
        events.append(event)
    return events


def stream(
    request: dict[str, Any], chunks: list[dict[str, Any]], *, fail: str = ""
) -> list[dict[str, Any]]:
    translator = ResponsesStreamTranslator(
        request, response_id="resp_abc", created_at=1700000000
    )
    out: list[bytes] = []
    for chunk in chunks:
        out += translator.feed(chunk)
    out += translator.fail(fail) if fail else translator.finish()
    events = parse_sse(b"".join(out))
    for event in events:
        EVENTS.validate_python(event)  # the SDK accepts every event as sent
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def reply_of(
    text: str, calls: list[tuple[str, str, str]], finish: str = "stop"
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
            for cid, n, a in calls
        ]
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "llama3:8b",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": USAGE,
    }


def chunks_of(
    text_pieces: list[str], calls: list[tuple[str, str, list[str]]], finish: str
) -> list[dict[str, Any]]:
    """A canonical stream: text pieces, then each call's argument pieces."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "llama3:8b"}
    chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    for piece in text_pieces:
        chunks.append({**head, "choices": [{"index": 0, "delta": {"content": piece}}]})
    for index, (cid, name, pieces) in enumerate(calls):
        first = {
            "index": index,
            "id": cid,
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        chunks.append(
            {**head, "choices": [{"index": 0, "delta": {"tool_calls": [first]}}]}
        )
        for piece in pieces:
            call = {"index": index, "function": {"arguments": piece}}
            chunks.append(
                {**head, "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}
            )
    chunks.append(
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    )
    chunks.append({**head, "choices": [], "usage": USAGE})
    return chunks


# Requests


def test_string_input_and_instructions_become_system_and_user_messages():
    chat = responses_to_chat(
        {"model": "m", "instructions": "Be brief.", "input": "Hello", "stream": True}
    )
    assert chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_items_with_images_tools_and_outputs_become_a_chat():
    chat = responses_to_chat(
        {
            "model": "m",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is in"},
                        {
                            "type": "input_image",
                            "image_url": "data:image/png;base64,iVBOR",
                            "detail": "low",
                        },
                    ],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Let me look."}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "lookup",
                    "arguments": '{"q":"cat"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "cat"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "lookup",
                    "description": "Look up",
                    "parameters": {"type": "object"},
                    "strict": True,
                }
            ],
            "tool_choice": {"type": "function", "name": "lookup"},
            "parallel_tool_calls": False,
            "max_output_tokens": 64,
            "temperature": 0.2,
            "top_p": 0.9,
            "text": {"format": {"type": "json_schema", "name": "o", "schema": {}}},
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "Use tools."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in"},
                {
                    "type": "image_url",
                    "image_url": {
                        "url": "data:image/png;base64,iVBOR",
                        "detail": "low",
                    },
                },
            ],
        },
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q":"cat"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "cat"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look up",
                "parameters": {"type": "object"},
                "strict": True,
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["max_tokens"] == 64
    assert (chat["temperature"], chat["top_p"]) == (0.2, 0.9)
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "o", "schema": {}},
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("previous_response_id", "resp_123"),
        ("conversation", "conv_1"),
        ("prompt", {"id": "pmpt_1"}),
        ("background", True),
    ],
)
def test_what_needs_stored_state_is_refused_saying_nexus_is_stateless(field, value):
    with pytest.raises(TranslationError) as caught:
        responses_to_chat({"model": "m", "input": "hi", field: value})
    error = caught.value
    assert error.status == 400
    assert error.param == field
    assert "stateless" in error.message
    assert "'input'" in error.message


def test_store_is_accepted_and_nothing_is_stored():
    chat = responses_to_chat({"model": "m", "input": "hi", "store": True})
    assert "store" not in chat
    response = chat_to_response(
        reply_of("ok", []), {"model": "m", "store": True}, response_id="r", created_at=1
    )
    assert response["store"] is False


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"type": "item_reference", "id": "msg_1"}]},
            "input[0]",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "file_id": "file-1"}],
                    }
                ]
            },
            "input[0].content[0].file_id",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_file", "file_data": "x"}],
                    }
                ]
            },
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"model": 3}, "model"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ],
)
def test_what_the_canonical_form_cannot_carry_is_a_400_naming_the_field(body, param):
    with pytest.raises(TranslationError) as caught:
        responses_to_chat({"model": "m", "input": "hi", **body})
    assert caught.value.status == 400
    assert caught.value.param == param


# Replies


def test_reply_with_text_and_calls_is_a_response_the_sdk_reads():
    request = {"model": "alias", "input": "hi", "instructions": "x"}
    reply = reply_of("Hello there", [("call_7", "lookup", '{"q": 1}')], "tool_calls")
    response = Response.model_validate(
        chat_to_response(reply, request, response_id="resp_1", created_at=5)
    )
    assert response.output_text == "Hello there"
    assert response.status == "completed"
    assert response.model == "llama3:8b"
    assert response.instructions == "x"
    call = response.output[1]
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == (
        "call_7",
        "lookup",
        '{"q": 1}',
    )
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (7, 5)
    assert response.usage.total_tokens == 12


def test_a_reply_cut_by_the_token_limit_is_incomplete():
    response = chat_to_response(
        reply_of("Hel", [], "length"), {"model": "m"}, response_id="r", created_at=1
    )
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


# Streams


def test_stream_sends_the_event_sequence_the_sdk_expects():
    chunks = chunks_of(["Hel", "lo"], [("call_1", "f", ['{"a"', ": 1}"])], "tool_calls")
    events = stream({"model": "m", "input": "x"}, chunks)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-1]["response"]
    assert done["usage"]["input_tokens"] == 7
    assert done["output"][1]["arguments"] == '{"a": 1}'
    assert events[0]["response"]["status"] == "in_progress"


def test_a_stream_that_breaks_off_ends_with_error_and_response_failed():
    chunks = chunks_of(["partial"], [], "stop")[:2]
    events = stream({"model": "m"}, chunks, fail="backend went away")
    assert [e["type"] for e in events[-5:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    assert events[-2]["message"] == "backend went away"
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "backend went away"}
    assert failed["output"][0]["status"] == "incomplete"


def test_arguments_before_the_name_are_sent_once_the_name_is_known():
    head = {"model": "m"}
    chunks = [
        {**head, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]},
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]
                    },
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]},
                    "finish_reason": "tool_calls",
                }
            ],
        },
    ]
    events = stream({"model": "m"}, chunks)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert added[0]["item"]["name"] == "f"
    deltas = [
        e["delta"]
        for e in events
        if e["type"] == "response.function_call_arguments.delta"
    ]
    assert deltas == ["{}"]


# Properties

texts = st.text(max_size=40)
json_args = st.dictionaries(
    st.text(min_size=1, max_size=8), st.integers() | st.text(max_size=8), max_size=3
).map(json.dumps)
names = st.from_regex(r"[a-z_]{1,12}", fullmatch=True)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a]


@settings(max_examples=100, deadline=None)
@given(
    text=texts,
    calls=st.lists(st.tuples(names, json_args), max_size=3),
    finish=st.sampled_from(["stop", "length", "tool_calls"]),
    cuts=st.lists(st.integers(min_value=0), max_size=6),
)
def test_streamed_and_whole_replies_make_the_same_response(text, calls, finish, cuts):
    """Any chunking of a reply streams to the response the whole reply gives."""
    ids = [(f"call_{i}", name, args) for i, (name, args) in enumerate(calls)]
    request = {"model": "m", "input": "x"}
    whole = chat_to_response(
        reply_of(text, ids, finish), request, response_id="resp_abc", created_at=1
    )
    pieces = [(cid, name, split(args, cuts)) for cid, name, args in ids]
    events = stream(request, chunks_of(split(text, cuts), pieces, finish))
    final = events[-1]["response"]
    assert final["output"] == whole["output"]
    assert (final["status"], final["usage"]) == (whole["status"], whole["usage"])
    deltas = "".join(
        e["delta"] for e in events if e["type"] == "response.output_text.delta"
    )
    assert deltas == text


def to_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The inverse of the request translation (an oracle for the property)."""
    items: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message["tool_call_id"],
                    "output": message["content"],
                }
            )
            continue
        if message.get("content") is not None:
            content = message["content"]
            if role == "assistant":
                content = [{"type": "output_text", "text": content}]
            items.append({"type": "message", "role": role, "content": content})
        for call in message.get("tool_calls", []):
            items.append(
                {
                    "type": "function_call",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                }
            )
    return items


user_item = texts.map(lambda t: {"type": "message", "role": "user", "content": t})
system_item = texts.map(lambda t: {"type": "message", "role": "system", "content": t})
# An empty assistant text before a call is dropped (content null): not generated.
assistant_item = st.text(min_size=1, max_size=40).map(
    lambda t: {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": t}],
    }
)
call_pair = st.tuples(st.uuids(), names, json_args, texts).map(
    lambda c: [
        {
            "type": "function_call",
            "call_id": f"call_{c[0].hex}",
            "name": c[1],
            "arguments": c[2],
        },
        {"type": "function_call_output", "call_id": f"call_{c[0].hex}", "output": c[3]},
    ]
)


@settings(max_examples=100, deadline=None)
@given(
    groups=st.lists(
        st.one_of(
            user_item.map(lambda i: [i]),
            system_item.map(lambda i: [i]),
            assistant_item.map(lambda i: [i]),
            call_pair,
        ),
        min_size=1,
        max_size=6,
    )
)
def test_input_items_survive_the_round_trip_through_chat_messages(groups):
    items = [item for group in groups for item in group]
    chat = responses_to_chat({"model": "m", "input": items})
    assert to_items(chat["messages"]) == items
