"""Live per-backend load and latency of this process, read while scoring.

These change with every request, so they live outside the immutable snapshot:
a snapshot swap keeps them, and they are keyed by backend name. Writers take a
lock (uncontended on an event loop, and correct under threads); readers do
not, because a single dict lookup is atomic in CPython and scoring must not
wait on anything.

Counts are per process. With several serving processes each sees its own
share of the load, which is what it can act on without a network round trip.

Open circuit breakers live here too (``open_circuit``), because the router must
skip them on the hot path without I/O. ``backends.breaker`` decides when a
circuit opens and spreads openings to the other serving processes; this class
only remembers until when each circuit stays open.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import TypedDict

from routing.core.types import BackendSpec


class BackendStatsDict(TypedDict):
    """One backend's live numbers, as shown by dashboards and --explain."""

    in_flight: int
    latency_ms: float | None


class LiveStats:
    """In-flight request counts and a latency EWMA for each backend.

    Feed ``observe_latency`` the time to the first byte of the upstream answer,
    not the full generation time: the latter measures the prompt more than the
    backend. An observation older than ``stale_after`` seconds is ignored, and
    scoring falls back to the health checker's ``avg_latency_ms``, so that a
    backend that was slow once is not shunned forever.
    """

    def __init__(
        self,
        *,
        alpha: float = 0.3,
        stale_after: float | None = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be within (0, 1]")
        self.alpha = alpha
        self.stale_after = math.inf if stale_after is None else stale_after
        self.clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        # The same requests, per (backend, model): for dashboards, not scoring.
        self._in_flight_models: dict[tuple[str, str], int] = {}
        # backend name -> (EWMA in ms, clock() of the last observation)
        self._latency: dict[str, tuple[float, float]] = {}
        # backend name -> clock() until which its circuit breaker is open
        self._open_until: dict[str, float] = {}

    @property
    def in_flight_counts(self) -> Mapping[str, int]:
        """Live view of requests in flight per backend (absent means zero)."""
        return self._in_flight

    @property
    def in_flight_by_model(self) -> Mapping[tuple[str, str], int]:
        """Live view of requests in flight per (backend, model)."""
        return self._in_flight_models

    @property
    def observed_latencies(self) -> Mapping[str, tuple[float, float]]:
        """Live view of (EWMA ms, observed at) per backend."""
        return self._latency

    @property
    def open_circuits(self) -> Mapping[str, float]:
        """Live view of clock() deadlines of open circuits (may hold expired ones)."""
        return self._open_until

    def open_circuit(self, backend: str, until: float) -> None:
        """Keep `backend` out of routing until clock() reaches `until`.

        An opening never shortens one already in force.
        """
        with self._lock:
            if until > self._open_until.get(backend, -math.inf):
                self._open_until[backend] = until

    def close_circuit(self, backend: str) -> None:
        """Let `backend` take traffic again at once."""
        with self._lock:
            self._open_until.pop(backend, None)

    def is_circuit_open(self, backend: str) -> bool:
        """Return whether `backend`'s circuit breaker is open now (no I/O)."""
        until = self._open_until.get(backend)
        if until is None:
            return False
        if until > self.clock():
            return True
        with self._lock:
            # Forget the expired deadline unless a new opening replaced it.
            if self._open_until.get(backend) == until:
                del self._open_until[backend]
        return False

    def in_flight(self, backend: str) -> int:
        """Return how many requests are in flight to `backend`."""
        return self._in_flight.get(backend, 0)

    def latency_ms(self, backend: str) -> float | None:
        """Return the latency EWMA of `backend`, or None if none is recent."""
        observed = self._latency.get(backend)
        if observed is None or self.clock() - observed[1] > self.stale_after:
            return None
        return observed[0]

    def begin(self, backend: str) -> None:
        """Count one more request in flight to `backend`."""
        with self._lock:
            self._in_flight[backend] = self._in_flight.get(backend, 0) + 1

    def try_begin(self, backend: BackendSpec, model: str = "") -> bool:
        """Count a request (for `model`) to `backend` unless it is at max_concurrency.

        Check and increment happen together, so concurrent callers cannot both
        take the last slot. Returns whether the request was counted.
        """
        name = backend.name
        with self._lock:
            current = self._in_flight.get(name, 0)
            if current >= backend.capacity:
                return False
            self._in_flight[name] = current + 1
            key = (name, model)
            self._in_flight_models[key] = self._in_flight_models.get(key, 0) + 1
            return True

    def end(self, backend: str, model: str = "") -> None:
        """Count one request to `backend` (for `model`) as finished (never below 0)."""
        with self._lock:
            self._in_flight[backend] = max(self._in_flight.get(backend, 0) - 1, 0)
            key = (backend, model)
            count = self._in_flight_models.get(key, 0) - 1
            if count > 0:
                self._in_flight_models[key] = count
            else:
                self._in_flight_models.pop(key, None)

    def observe_latency(self, backend: str, latency_ms: float) -> None:
        """Fold one latency measurement into `backend`'s EWMA.

        Negative, NaN and infinite measurements are ignored.
        """
        if not math.isfinite(latency_ms) or latency_ms < 0:
            return
        now = self.clock()
        with self._lock:
            previous = self._latency.get(backend)
            if previous is None or now - previous[1] > self.stale_after:
                value = latency_ms
            else:
                value = previous[0] + self.alpha * (latency_ms - previous[0])
            self._latency[backend] = (value, now)

    def as_dict(self) -> dict[str, BackendStatsDict]:
        """Return every backend's current numbers."""
        names = set(self._in_flight) | set(self._latency)
        return {
            name: {
                "in_flight": self.in_flight(name),
                "latency_ms": self.latency_ms(name),
            }
            for name in sorted(names)
        }
