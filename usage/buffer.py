"""The in-process usage recorder: the proxy appends, a shipper drains. No ORM.

Appending is a deque append (each deque operation is atomic in CPython), so
the request path takes no lock and never waits. Each serving process's gateway owns one buffer; in the
embedded default ``usage/flush.py`` writes it to the database, in production
``usage/stream.py`` ships it to a Redis stream that the Celery worker drains.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import operator
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

Endpoint = Literal[
    "chat",
    "completions",
    "embeddings",
    "messages",
    "responses",
    "ollama-chat",
    "ollama-generate",
    "ollama-embed",
]

# Event ids: a random per-process prefix and a counter, unique across processes
# and restarts, and far cheaper per request than uuid4().
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count(1)


def new_event_id() -> str:
    """Return an id no other usage event of any process has (32 characters)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def _reseed_after_fork() -> None:
    global _ID_PREFIX, _ID_COUNTER
    _ID_PREFIX = os.urandom(8).hex()
    _ID_COUNTER = itertools.count(1)


os.register_at_fork(after_in_child=_reseed_after_fork)


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """One finished (or failed) gateway request, as the proxy saw it.

    Token counts come from the backend's usage block; when the backend sent
    none they are Nexus's estimate and ``estimated`` is true. ``status`` is the
    HTTP status the client got (for a stream that failed after its first byte,
    the error is recorded in ``error`` and status stays 200).
    """

    request_id: str
    endpoint: Endpoint
    api_key_prefix: str  # "" when client auth is off
    backend: str  # "" when no backend was reached
    requested_model: str
    served_model: str
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    estimated: bool
    latency_ms: float  # from request received to the last byte sent
    status: int
    streamed: bool
    error: str = ""  # short error code/type; "" for success
    cost_nanos: int = 0  # at the served model's price, in nano-USD
    created_at: float = field(default_factory=time.time)  # Unix time, seconds
    # Nexus's own unique id for this event: the flusher's idempotency key. Not
    # request_id, which a client may choose (X-Request-Id) and may repeat for
    # requests that each consumed tokens.
    event_id: str = field(default_factory=new_event_id)

    @property
    def is_error(self) -> bool:
        return bool(self.error) or self.status >= 400


class UsageBuffer:
    """Usage events not yet handed on (to the database or a Redis stream)."""

    def __init__(self, maxlen: int | None = None) -> None:
        # A last-resort bound: during an outage the gateway's task spills
        # what is over a tenth of it to disk (usage/spill.py); only a burst
        # faster than that task would hit it, and the oldest events are then
        # dropped first and counted, never silently. Only append() enforces
        # it: a deque's own maxlen would make requeue() push the newest
        # events out of the other end, uncounted.
        self._events: deque[UsageEvent] = deque()
        self.dropped = 0  # since the flusher last reported drops
        self.dropped_total = 0  # since the process started
        self._maxlen = maxlen

    @property
    def maxlen(self) -> int | None:
        return self._maxlen

    def append(self, event: UsageEvent) -> None:
        events = self._events
        if self._maxlen is not None and len(events) >= self._maxlen:
            try:
                events.popleft()
            except IndexError:
                pass  # a drain in another thread emptied it meanwhile
            else:
                self.dropped += 1
                self.dropped_total += 1
        events.append(event)

    def drain(self, limit: int | None = None) -> list[UsageEvent]:
        """Remove and return up to `limit` events, oldest first."""
        events: list[UsageEvent] = []
        pop = self._events.popleft
        while self._events and (limit is None or len(events) < limit):
            events.append(pop())
        return events

    def requeue(self, events: list[UsageEvent]) -> None:
        """Put events back at the front (a flush that failed); order is kept.

        Nothing is dropped, even past the bound: these events were taken out
        by a hand-on that failed while newer ones kept arriving, and the
        caller spills what is over its share next. So the buffer holds at
        most its bound plus one batch, as while that batch was in flight.
        """
        self._events.extendleft(reversed(events))

    def __len__(self) -> int:
        return len(self._events)


_FIELDS = tuple(field.name for field in dataclasses.fields(UsageEvent))
_values_of = operator.attrgetter(*_FIELDS)


def encode_events(events: list[UsageEvent]) -> bytes:
    """Serialise a batch of events (field names kept, so they survive upgrades)."""
    return json.dumps(
        {"fields": _FIELDS, "events": [_values_of(event) for event in events]},
        separators=(",", ":"),
    ).encode()


def decode_events(data: bytes) -> list[UsageEvent]:
    """Read a batch written by encode_events(); unknown fields are ignored."""
    batch = json.loads(data)
    if not isinstance(batch, dict):
        raise TypeError("a usage batch must be a JSON object")
    names = batch["fields"]
    known = [(index, name) for index, name in enumerate(names) if name in _FIELDS]
    return [
        UsageEvent(**{name: values[index] for index, name in known})
        for values in batch["events"]
    ]
