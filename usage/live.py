"""This process's live usage counters, for the dashboard and the usage stream.

The proxy updates them on every request (dict updates, no I/O, no lock on the
event loop); a publisher reads ``snapshot()`` and fans it out over the Channels
layer so that the dashboard shows the whole cluster. Totals only grow, so a
reader derives rates from two snapshots. Requests in flight are not counted
here but read, at snapshot time, from the one counter the router also uses
(``in_flight``), so the dashboard and routing never disagree.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

from usage.buffer import UsageEvent

LATENCY_WINDOW = 512  # recent latencies kept per model, for p50/p95
# Finished requests are also counted per time slot of this many seconds, for
# the last RECENT_SECONDS: the dashboard's five-minute chart and its rates.
SLOT_SECONDS = 10
RECENT_SECONDS = 360


class SeriesDict(TypedDict):
    backend: str
    model: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    in_flight: int


class SlotDict(TypedDict):
    """Requests that finished in one time slot (start in Unix seconds)."""

    start: int
    requests: int
    errors: int
    total_tokens: int


class AdmissionPoolDict(TypedDict):
    """One pool of admission control: its stock against its band, its queue.

    ``dispatch_limit`` / ``bypass_limit`` are whole requests (a process's
    share; merged, the gateway's); ``lower`` / ``upper`` / ``watermark`` the
    gateway's band. ``flows`` counts the requests waiting per flow. With the
    stock counted in tokens (``unit``), ``stock`` and all of the band are
    tokens.
    """

    pool: str  # the served model whose requests it holds
    backends: list[str]
    models: list[str]
    unit: str
    stock: int
    waiting: int
    lower: float
    upper: float
    watermark: float
    dispatch_limit: int
    bypass_limit: int
    flows: dict[str, int]


class AdmissionLiveDict(TypedDict):
    """A process's admission control, for the dashboard (totals only grow)."""

    enabled: bool
    pools: list[AdmissionPoolDict]
    # Requests not sent to a backend, by error code (queue_full, ...).
    rejections: dict[str, int]
    preemptions: dict[str, int]  # by the preempted request's criticality
    bypassed: int
    dispatched: int
    changes: int


class LiveSnapshotDict(TypedDict):
    process: str
    taken_at: float
    changes: int
    series: list[SeriesDict]
    latencies_ms: dict[str, list[float]]
    recent: list[SlotDict]
    # Absent from a process of an older version.
    admission: NotRequired[AdmissionLiveDict | None]


@dataclass(slots=True)
class _Series:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def _nothing_in_flight() -> Mapping[tuple[str, str], int]:
    return {}


def _no_admission() -> AdmissionLiveDict | None:
    return None


@dataclass
class LiveUsage:
    """Counters per backend × model since this process started.

    ``in_flight`` returns the live count of requests in flight per
    (backend, model) and ``admission`` the admission control's state (both
    injected by the gateway: usage may not import routing); ``version()``
    moves whenever a snapshot would differ.
    Finished requests are also counted per SLOT_SECONDS slot of the last
    RECENT_SECONDS (a bounded dict; ``clock`` gives Unix time).
    """

    in_flight: Callable[[], Mapping[tuple[str, str], int]] = _nothing_in_flight
    admission: Callable[[], AdmissionLiveDict | None] = _no_admission
    admission_changes: Callable[[], int] = int
    clock: Callable[[], float] = time.time
    process: str = field(
        default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}"
    )
    changes: int = 0
    _series: dict[tuple[str, str], _Series] = field(default_factory=dict)
    _latencies: dict[str, deque[float]] = field(default_factory=dict)
    # slot start -> [requests, errors, total tokens]
    _recent: dict[int, list[int]] = field(default_factory=dict)

    def _get(self, backend: str, model: str) -> _Series:
        series = self._series.get((backend, model))
        if series is None:
            series = self._series[(backend, model)] = _Series()
        return series

    def version(self) -> int:
        """A number that moves whenever a snapshot would differ."""
        return self.changes + self.admission_changes()

    def touch(self) -> None:
        """Note that something a snapshot shows changed (a request began)."""
        self.changes += 1

    def record(self, event: UsageEvent, model: str | None = None) -> None:
        """Count one finished request, under `model` when given.

        The gateway gives the model its metrics name (one the configuration
        knows, or "unknown"), so that the series stay as few as the models
        configured, whatever names clients send.
        """
        if model is None:
            model = event.served_model or event.requested_model
        series = self._get(event.backend, model)
        series.requests += 1
        series.errors += event.is_error
        series.prompt_tokens += event.prompt_tokens
        series.completion_tokens += event.completion_tokens
        series.total_tokens += event.total_tokens
        start = int(self.clock()) // SLOT_SECONDS * SLOT_SECONDS
        slot = self._recent.get(start)
        if slot is None:
            self._forget_old_slots(start)
            slot = self._recent[start] = [0, 0, 0]
        slot[0] += 1
        slot[1] += event.is_error
        slot[2] += event.total_tokens
        if not event.is_error:
            window = self._latencies.get(model)
            if window is None:
                window = self._latencies[model] = deque(maxlen=LATENCY_WINDOW)
            window.append(event.latency_ms)
        self.changes += 1

    def _forget_old_slots(self, now: int) -> None:
        for start in [start for start in self._recent if start <= now - RECENT_SECONDS]:
            del self._recent[start]

    def snapshot(self) -> LiveSnapshotDict:
        """A JSON-ready copy of every counter."""
        self._forget_old_slots(int(self.clock()))
        in_flight = self.in_flight()
        for key, count in in_flight.items():
            if count and key not in self._series:
                self._series[key] = _Series()
        return {
            "process": self.process,
            "taken_at": time.time(),
            "changes": self.version(),
            "admission": self.admission(),
            "series": [
                {
                    "backend": backend,
                    "model": model,
                    "requests": s.requests,
                    "errors": s.errors,
                    "prompt_tokens": s.prompt_tokens,
                    "completion_tokens": s.completion_tokens,
                    "total_tokens": s.total_tokens,
                    "in_flight": in_flight.get((backend, model), 0),
                }
                for (backend, model), s in sorted(self._series.items())
            ],
            "latencies_ms": {
                model: [round(x, 3) for x in window]
                for model, window in sorted(self._latencies.items())
            },
            "recent": [
                {"start": start, "requests": r, "errors": e, "total_tokens": t}
                for start, (r, e, t) in sorted(self._recent.items())
            ],
        }
