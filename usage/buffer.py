"""The in-process usage recorder: the proxy appends, the flusher drains. No ORM.

Appending is a deque append (atomic in CPython), so the request path takes no
lock and never waits. ``usage/flush.py`` drains the buffer in sync code and is
the only writer of usage rows.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

Endpoint = Literal["chat", "completions", "embeddings"]


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
    created_at: float = field(default_factory=time.time)  # Unix time, seconds
    # Nexus's own unique id for this event: the flusher's idempotency key. Not
    # request_id, which a client may choose (X-Request-Id) and may repeat for
    # requests that each consumed tokens.
    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def is_error(self) -> bool:
        return bool(self.error) or self.status >= 400


class UsageBuffer:
    """Usage events not yet written to the database."""

    def __init__(self, maxlen: int | None = None) -> None:
        # A bound protects memory if the database is down for long; the oldest
        # events are dropped first and counted, never silently.
        self._events: deque[UsageEvent] = deque(maxlen=maxlen)
        self.dropped = 0
        self._maxlen = maxlen

    def append(self, event: UsageEvent) -> None:
        if self._maxlen is not None and len(self._events) == self._maxlen:
            self.dropped += 1
        self._events.append(event)

    def drain(self, limit: int | None = None) -> list[UsageEvent]:
        """Remove and return up to `limit` events, oldest first."""
        events: list[UsageEvent] = []
        pop = self._events.popleft
        while self._events and (limit is None or len(events) < limit):
            events.append(pop())
        return events

    def requeue(self, events: list[UsageEvent]) -> None:
        """Put events back at the front (a flush that failed); order is kept."""
        self._events.extendleft(reversed(events))

    def __len__(self) -> int:
        return len(self._events)


# The buffer of this process.
buffer = UsageBuffer(maxlen=1_000_000)
