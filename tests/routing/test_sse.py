"""The stream relay: events cut at any byte, linear work, the event size cap."""

from __future__ import annotations

import pytest

from routing.proxy.sse import EventTooLarge, StreamRelay

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
    long_event = b"data: " + b"y" * 9000 + b"\n\n"
    out = b"".join(relay.feed(long_event[i : i + 100]) for i in range(0, 9008, 100))
    assert out == long_event
