"""The stream relay: events cut at any byte, linear work, the event size cap."""

from __future__ import annotations

import json

import pytest

from gateway.proxy.sse import EventTooLarge, InvalidEvent, StreamRelay

pytestmark = pytest.mark.mode_independent

EVENTS = (
    b'data: {"choices": [{"delta": {"content": "one"}}]}\n\n'
    b'data: {"choices": [{"delta": {"content": "two"}}]}\r\n\r\n'
    b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64])
def test_events_split_anywhere_come_out_whole(size: int) -> None:
    relay = StreamRelay(wants_usage_chunk=True, keep_bytes=1024)
    out = b"".join(
        relay.feed(EVENTS[i : i + size]) for i in range(0, len(EVENTS), size)
    )
    assert out + relay.rest() == EVENTS
    assert relay.usage == {"prompt_tokens": 2, "completion_tokens": 3}


def test_the_usage_only_event_is_stripped_unless_asked() -> None:
    relay = StreamRelay(wants_usage_chunk=False, keep_bytes=1024)
    out = relay.feed(EVENTS)
    assert b'"usage"' not in out
    assert out.endswith(b"data: [DONE]\n\n")


def test_an_event_that_never_ends_stops_at_the_cap() -> None:
    relay = StreamRelay(wants_usage_chunk=False, keep_bytes=1024, max_event=10_000)
    relay.feed(b'data: {"choices": [{"delta": {"content": "')
    with pytest.raises(EventTooLarge):
        for _ in range(1000):
            relay.feed(b"x" * 1000)
    assert relay.rest() == b""  # nothing of it is kept


def test_events_within_the_cap_pass_after_a_long_one() -> None:
    relay = StreamRelay(wants_usage_chunk=False, keep_bytes=1024, max_event=10_000)
    long_event = b'data: {"p": "' + b"y" * 8989 + b'"}\n\n'
    out = b"".join(relay.feed(long_event[i : i + 100]) for i in range(0, 9008, 100))
    assert out == long_event


def _chunk_event(text: str) -> bytes:
    payload = {"choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@pytest.mark.parametrize(
    "bad",
    [
        b"data: {broken\n\n",
        b"data: [1, 2]\n\n",
        b'data: {"choices": "\xff\xfe"}\n\n',
        b"data: <html>oops</html>\r\n\r\n",
        b"data: {\ndata: broken\n\n",
    ],
    ids=["not-json", "not-an-object", "bad-utf8", "crlf-html", "multi-line"],
)
def test_a_later_event_that_is_not_a_json_object_raises_with_what_came_before(
    bad: bytes,
) -> None:
    relay = StreamRelay(wants_usage_chunk=False, keep_bytes=1024)
    assert relay.feed(_chunk_event("a")) == _chunk_event("a")
    with pytest.raises(InvalidEvent) as raised:
        relay.feed(_chunk_event("b") + bad + _chunk_event("c"))
    assert raised.value.before == _chunk_event("b")


def test_valid_events_of_every_kind_pass_the_check() -> None:
    relay = StreamRelay(wants_usage_chunk=True, keep_bytes=1024)
    events = (
        b": keep-alive\n\n"
        + b'event: message\ndata: {"x": 1}\n\n'
        + b'data: {"usage": {"prompt_tokens": 100000000000000000000000}}\n\n'
        + b'data:{"a":\ndata: 2}\n\n'
        + b"data: [DONE]\n\n"
    )
    assert relay.feed(events[:7]) == b""
    assert relay.feed(events[7:]) == events
