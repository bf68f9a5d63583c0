"""The in-process usage recorder: the proxy appends, a shipper drains. No ORM.

Three kinds of items go through it, in order: a ``UsageOpen`` when a request
is admitted to the pipeline (and again, with what was seen so far, while a
long stream goes on: progress), the request's ``UsageEvent`` when it ends
(its settle, with the same ``event_id``), and a ``UsageBeat`` now and then
from a process with requests open. A process killed without warning thus
leaves the opens it had handed on, which the beat reconciliation turns into
records (``usage/lost.py``).

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
from collections.abc import Callable
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


def process_id() -> str:
    """Return this process's id (the prefix of its event ids, 16 characters)."""
    return _ID_PREFIX


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
    # Times context shift trimmed the request (gateway/proxy/context_shift.py);
    # the tokens are the successful attempt's only.
    context_shifts: int = 0
    # One id for every request of a multiple-opinions ensemble (moe-<model>,
    # gateway/proxy/ensemble.py); "" for any other request.
    ensemble_id: str = ""
    # Of prompt_tokens: those the backend read from its prompt cache, and
    # those it wrote to it (Anthropic's cache creation).
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    # Answered from the response cache (gateway/cache/): its tokens are the
    # stored answer's, saved rather than spent (cost: the hit price, if any).
    cache_hit: bool = False
    # The split the requested name is and the side (model) the request was
    # put on (routing.core.traffic); "" for a name that is no split.
    split: str = ""
    split_side: str = ""
    # A second attempt raced the first (gateway/proxy/hedging.py).
    hedged: bool = False
    # The routing decision as compact JSON (the explain of a past request
    # reads it: routing/past_requests.py), or a function that writes it: the
    # gateway leaves that work to whoever hands the event on, off the
    # request path (decision_text()).
    decision: str | Callable[[], str] = ""
    # A batch job's line: the batch's id ("" for any other request).
    batch_id: str = ""

    @property
    def is_error(self) -> bool:
        return bool(self.error) or self.status >= 400

    def decision_text(self) -> str:
        """The decision as JSON ("" for none), written now if it was deferred."""
        decision = self.decision
        return decision if isinstance(decision, str) else decision()


@dataclass(frozen=True, slots=True)
class UsageOpen:
    """A request admitted and not yet ended, as far as it got (see the module).

    Written when the request enters the pipeline, and again with its latest
    numbers (backend, tokens counted so far) while a stream goes on; the
    request's ``UsageEvent`` with the same ``event_id`` settles it.
    """

    event_id: str
    process: str  # process_id() of the serving process
    request_id: str
    endpoint: str
    api_key_prefix: str
    requested_model: str
    streamed: bool
    created_at: float  # Unix time, seconds: when the request was admitted
    backend: str = ""
    served_model: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cost_nanos: int = 0
    status: int = 0  # the status sent so far (0: no answer yet)
    # The multiple-opinions ensemble it is a step of ("" for any other
    # request): a step recorded lost is still linked to its ensemble.
    ensemble_id: str = ""
    # The batch job it is a line of (""): a line recorded lost stays one.
    batch_id: str = ""


@dataclass(frozen=True, slots=True)
class UsageBeat:
    """A serving process is alive and has requests open (see ``usage/lost.py``)."""

    process: str


UsageItem = UsageEvent | UsageOpen | UsageBeat


class UsageBuffer:
    """Usage items not yet handed on (to the database or a Redis stream)."""

    def __init__(self, maxlen: int | None = None) -> None:
        # A last-resort bound: during an outage the gateway's task spills
        # what is over a tenth of it to disk (usage/spill.py); only a burst
        # faster than that task would hit it, and the oldest events are then
        # dropped first and counted, never silently. Only append() enforces
        # it: a deque's own maxlen would make requeue() push the newest
        # events out of the other end, uncounted.
        self._events: deque[UsageItem] = deque()
        self.dropped = 0  # since the flusher last reported drops
        self.dropped_total = 0  # since the process started
        self._maxlen = maxlen

    @property
    def maxlen(self) -> int | None:
        return self._maxlen

    def append(self, event: UsageItem) -> None:
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

    def drain(self, limit: int | None = None) -> list[UsageItem]:
        """Remove and return up to `limit` items, oldest first."""
        events: list[UsageItem] = []
        pop = self._events.popleft
        while self._events and (limit is None or len(events) < limit):
            events.append(pop())
        return events

    def requeue(self, events: list[UsageItem]) -> None:
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
_DECISION = _FIELDS.index("decision")
_OPEN_FIELDS = tuple(field.name for field in dataclasses.fields(UsageOpen))
_open_values_of = operator.attrgetter(*_OPEN_FIELDS)


def encode_events(items: list[UsageItem]) -> bytes:
    """Serialise a batch of items (field names kept, so they survive upgrades).

    Settles are under "fields"/"events" as ever; opens and beats under keys of
    their own, which a reader that predates them ignores.
    """
    events, opens, beats = [], [], []
    for item in items:
        if isinstance(item, UsageEvent):
            values = _values_of(item)
            if not isinstance(item.decision, str):
                values = (
                    *values[:_DECISION],
                    item.decision_text(),
                    *values[_DECISION + 1 :],
                )
            events.append(values)
        elif isinstance(item, UsageOpen):
            opens.append(_open_values_of(item))
        else:
            beats.append(item.process)
    batch: dict[str, object] = {"fields": _FIELDS, "events": events}
    if opens:
        batch["open_fields"] = _OPEN_FIELDS
        batch["opens"] = opens
    if beats:
        batch["beats"] = beats
    return json.dumps(batch, separators=(",", ":")).encode()


def decode_events(data: bytes) -> list[UsageItem]:
    """Read a batch written by encode_events(); unknown fields are ignored.

    Opens come first, then beats, then settles: a settle read with its open
    in one batch settles it whatever the order they were appended in.
    """
    batch = json.loads(data)
    if not isinstance(batch, dict):
        raise TypeError("a usage batch must be a JSON object")
    items: list[UsageItem] = []
    if "opens" in batch:
        names = batch["open_fields"]
        known = [(i, name) for i, name in enumerate(names) if name in _OPEN_FIELDS]
        items.extend(
            UsageOpen(**{name: values[i] for i, name in known})
            for values in batch["opens"]
        )
    items.extend(UsageBeat(str(process)) for process in batch.get("beats", ()))
    names = batch["fields"]
    known = [(index, name) for index, name in enumerate(names) if name in _FIELDS]
    items.extend(
        UsageEvent(**{name: values[index] for index, name in known})
        for values in batch["events"]
    )
    return items
