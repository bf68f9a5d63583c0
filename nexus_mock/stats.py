"""What the mock backend has seen: counters, gauges and recent requests."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

MAX_RECORDED_BODY = 64 * 1024


@dataclass(slots=True)
class RecordedRequest:
    """A request as it arrived, kept for tests to inspect."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    received_at: float
    status: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.target,
            "headers": self.headers,
            "body": self.body[:MAX_RECORDED_BODY].decode("utf-8", "replace"),
            "status": self.status,
            "received_at": self.received_at,
        }


@dataclass
class MockStats:
    """Counters since start or the last reset; gauges are never reset."""

    requests: Counter[str] = field(default_factory=Counter)
    responses: Counter[int] = field(default_factory=Counter)
    connections_total: int = 0
    client_disconnects: int = 0
    dropped_streams: int = 0
    injected_failures: int = 0
    context_overflows: int = 0
    # Inference requests given the slow tail's extra delay (slow_rate).
    slow_requests: int = 0
    blob_bytes: int = 0  # of Ollama model files received (/api/blobs)
    recorded: deque[RecordedRequest] = field(default_factory=deque)
    in_flight: int = 0
    open_connections: int = 0
    # With --slots: requests in a slot, waiting for one, and the peaks of both
    # and of their sum (what the callers had outstanding here) since the reset.
    busy_slots: int = 0
    waiting_for_slot: int = 0
    peak_busy_slots: int = 0
    peak_waiting_for_slot: int = 0
    peak_outstanding: int = 0

    def note_slots(self) -> None:
        """Update the peaks after busy_slots or waiting_for_slot changed."""
        self.peak_busy_slots = max(self.peak_busy_slots, self.busy_slots)
        self.peak_waiting_for_slot = max(
            self.peak_waiting_for_slot, self.waiting_for_slot
        )
        self.peak_outstanding = max(
            self.peak_outstanding, self.busy_slots + self.waiting_for_slot
        )

    def reset(self) -> None:
        """Zero the counters and forget recorded requests."""
        self.requests.clear()
        self.responses.clear()
        self.recorded.clear()
        self.connections_total = 0
        self.client_disconnects = 0
        self.dropped_streams = 0
        self.injected_failures = 0
        self.context_overflows = 0
        self.slow_requests = 0
        self.blob_bytes = 0
        self.peak_busy_slots = self.busy_slots
        self.peak_waiting_for_slot = self.waiting_for_slot
        self.peak_outstanding = self.busy_slots + self.waiting_for_slot

    def as_dict(self) -> dict[str, Any]:
        """Return the stats as JSON-ready values, oldest recorded request first."""
        return {
            "requests_total": sum(self.requests.values()),
            "requests": dict(self.requests),
            "responses": {str(code): n for code, n in sorted(self.responses.items())},
            "in_flight": self.in_flight,
            "open_connections": self.open_connections,
            "connections_total": self.connections_total,
            "client_disconnects": self.client_disconnects,
            "dropped_streams": self.dropped_streams,
            "injected_failures": self.injected_failures,
            "context_overflows": self.context_overflows,
            "slow_requests": self.slow_requests,
            "blob_bytes": self.blob_bytes,
            "busy_slots": self.busy_slots,
            "waiting_for_slot": self.waiting_for_slot,
            "peak_busy_slots": self.peak_busy_slots,
            "peak_waiting_for_slot": self.peak_waiting_for_slot,
            "peak_outstanding": self.peak_outstanding,
            "last_requests": [record.as_dict() for record in self.recorded],
        }
