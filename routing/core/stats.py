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
only remembers until when each circuit stays open. So are connection
failures (``fail_connection``), the gateway's error cache: a backend that
refused a connection moments ago is skipped until a deadline, and the router
tells the least recently failed one by when each failed.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypedDict

from routing.core.types import BackendSpec
from routing.core.vocabulary import Trend

# Latency samples kept per (backend, model) for the fleet strategy's p75.
LATENCY_WINDOW = 100
# Samples before the p75 is trusted (the fleet strategy guesses before that).
MIN_LATENCY_SAMPLES = 20
# Time constants (seconds) of the short and long views of a backend's load.
TREND_FAST_SECONDS = 10.0
TREND_SLOW_SECONDS = 60.0
# In-flight difference between the two views that counts as a trend.
TREND_LOAD_DELTA = 0.5
# Ratio of recent to older latency that counts as a trend (and its inverse).
TREND_LATENCY_RATIO = 1.25


# Out-of-memory load failures remembered per backend (the newest ones).
OOM_REMEMBERED = 8
# A node's memory bandwidth (GB/s) is learned from decoding speeds: the weight
# of each new sample, and the range believed (a broken count is not).
BANDWIDTH_ALPHA = 0.3
MIN_BANDWIDTH_GBPS = 0.1
MAX_BANDWIDTH_GBPS = 100_000.0


@dataclass(slots=True)
class LoadFailures:
    """A backend's recent out-of-memory load failures (``LiveStats.note_oom``).

    ``times``: wall clock of each, oldest first. The rest is of the last one:
    the model, the server's words, the memory the node had reported in use
    before it (GB), and its memory as the error told (in use + available).
    """

    times: deque[float]
    model: str
    detail: str
    used_gb: float | None
    total_gb: float | None


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
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be within (0, 1]")
        self.alpha = alpha
        self.stale_after = math.inf if stale_after is None else stale_after
        self.clock = clock
        # Epoch seconds, to compare with times backends report (keep_alive expiry).
        self.wall_clock = wall_clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        # The same requests, per (backend, model): for dashboards, not scoring.
        self._in_flight_models: dict[tuple[str, str], int] = {}
        # backend name -> (EWMA in ms, clock() of the last observation)
        self._latency: dict[str, tuple[float, float]] = {}
        # backend name -> clock() until which its circuit breaker is open
        self._open_until: dict[str, float] = {}
        # backend name -> (clock() until which it is skipped, clock() of the
        # connection failure) while it is in the error cache
        self._failed: dict[str, tuple[float, float]] = {}
        # The fleet strategy's live signals (see routing/core/fleet.py), keyed
        # by names from the snapshot, so they stay as small as the config.
        # (backend, model) -> requests waiting for it in a fleet queue
        self._waiting: dict[tuple[str, str], int] = {}
        # (backend, model) -> wall_clock() of the last request sent or answered
        # there: the backend loads the model for it, so it is loaded from then.
        self._served_at: dict[tuple[str, str], float] = {}
        # (backend, model) -> wall_clock() when this process expects the backend
        # to have unloaded it (a model it sent there needed the memory).
        self._evicted_at: dict[tuple[str, str], float] = {}
        # backend -> the models marked there (the keys of _served_at, by backend)
        self._marked: dict[str, set[str]] = {}
        self._model_latency: dict[tuple[str, str], LatencyWindow] = {}
        self._trends: dict[str, TrendTracker] = {}
        # backend name -> requests in flight there as the backend itself last
        # said (a relay worker's pong: every serving process's requests),
        # moved by this process's own requests since.
        self._reported: dict[str, int] = {}
        # backend name -> its recent out-of-memory load failures
        self._oom: dict[str, LoadFailures] = {}
        # backend name -> memory bandwidth (GB/s) learned from decoding speed,
        # and how fast it loads a model (GB/s) learned from warm-ups
        self._bandwidth: dict[str, float] = {}
        self._load_rate: dict[str, float] = {}

    @property
    def in_flight_counts(self) -> Mapping[str, int]:
        """Live view of requests in flight per backend (absent means zero)."""
        return self._in_flight

    @property
    def reported_loads(self) -> Mapping[str, int]:
        """Live view of the load backends report themselves (absent: none)."""
        return self._reported

    def report_load(self, backend: str, load: int) -> None:
        """`backend` says it has `load` requests in flight (all processes')."""
        with self._lock:
            self._reported[backend] = max(int(load), 0)

    def forget_load(self, backend: str) -> None:
        """`backend` no longer reports its load (its worker went away)."""
        with self._lock:
            self._reported.pop(backend, None)

    def load(self, backend: str) -> int:
        """Requests in flight at `backend`: this process's, or more when the
        backend reported more (the scoring's pending count)."""
        here = self._in_flight.get(backend, 0)
        reported = self._reported.get(backend)
        return here if reported is None or reported < here else reported

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

    @property
    def failed_connections(self) -> Mapping[str, tuple[float, float]]:
        """Live view of (skip until, failed at) per backend in the error cache
        (may hold expired ones)."""
        return self._failed

    def fail_connection(self, backend: str, until: float) -> bool:
        """Skip `backend` until clock() reaches `until`: a connection to it failed.

        Returns False (and changes nothing) when it is skipped already: the
        first failure's deadline stands, so that a backend is tried again on
        time however many requests saw it down meanwhile.
        """
        now = self.clock()
        with self._lock:
            current = self._failed.get(backend)
            if current is not None and current[0] > now:
                return False
            self._failed[backend] = (until, now)
            return True

    def forget_connection_failure(self, backend: str) -> None:
        """Let `backend` take traffic again at once (it answered)."""
        if backend in self._failed:
            with self._lock:
                self._failed.pop(backend, None)

    def connection_failed_at(self, backend: str) -> float | None:
        """clock() of `backend`'s connection failure while it is still skipped
        for it, else None (no I/O)."""
        failed = self._failed.get(backend)
        if failed is None:
            return None
        if failed[0] > self.clock():
            return failed[1]
        with self._lock:
            # Forget the expired entry unless a new failure replaced it.
            if self._failed.get(backend) == failed:
                del self._failed[backend]
        return None

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
            self._move_reported(backend, 1)
            self._track_load(backend)

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
            self._move_reported(name, 1)
            self._track_load(name)
            key = (name, model)
            self._in_flight_models[key] = self._in_flight_models.get(key, 0) + 1
            return True

    def end(self, backend: str, model: str = "") -> None:
        """Count one request to `backend` (for `model`) as finished (never below 0)."""
        with self._lock:
            self._in_flight[backend] = max(self._in_flight.get(backend, 0) - 1, 0)
            self._move_reported(backend, -1)
            self._track_load(backend)
            key = (backend, model)
            count = self._in_flight_models.get(key, 0) - 1
            if count > 0:
                self._in_flight_models[key] = count
            else:
                self._in_flight_models.pop(key, None)

    def observe_latency(self, backend: str, latency_ms: float, model: str = "") -> None:
        """Fold one latency measurement into `backend`'s EWMA.

        With `model`, it also feeds that (backend, model)'s p75 window and the
        backend's latency trend. Negative, NaN and infinite measurements are
        ignored.
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
            if model:
                key = (backend, model)
                window = self._model_latency.get(key)
                if window is None:
                    window = self._model_latency[key] = LatencyWindow()
                window.add(latency_ms)
                self._trend_of(backend).observe_latency(now, latency_ms)

    # The fleet strategy's live signals.

    def note_oom(
        self,
        backend: str,
        model: str,
        detail: str,
        *,
        used_gb: float | None = None,
        total_gb: float | None = None,
    ) -> None:
        """`backend` failed to load `model` for want of memory, as of now.

        ``used_gb``: what the node had reported in use; ``total_gb``: its
        memory as the error told, when it did (kept from an earlier failure
        otherwise).
        """
        with self._lock:
            record = self._oom.get(backend)
            if record is None:
                record = self._oom[backend] = LoadFailures(
                    deque(maxlen=OOM_REMEMBERED), model, detail, used_gb, total_gb
                )
            record.times.append(self.wall_clock())
            record.model, record.detail, record.used_gb = model, detail, used_gb
            if total_gb is not None:
                record.total_gb = total_gb

    def observe_bandwidth(self, backend: str, gbps: float) -> None:
        """Fold one decoding speed, as GB/s of weights read, into `backend`'s
        bandwidth (outside MIN/MAX_BANDWIDTH_GBPS: ignored)."""
        self._fold_rate(self._bandwidth, backend, gbps)

    def bandwidth_gbps(self, backend: str) -> float | None:
        """`backend`'s memory bandwidth as learned (None: no sample yet)."""
        return self._bandwidth.get(backend)

    def observe_load_rate(self, backend: str, gbps: float) -> None:
        """Fold one model load, as GB loaded per second, into `backend`'s load
        rate (outside MIN/MAX_BANDWIDTH_GBPS: ignored)."""
        self._fold_rate(self._load_rate, backend, gbps)

    def load_gbps(self, backend: str) -> float | None:
        """How fast `backend` loads a model, as learned (None: no sample yet)."""
        return self._load_rate.get(backend)

    def _fold_rate(self, rates: dict[str, float], backend: str, gbps: float) -> None:
        if not MIN_BANDWIDTH_GBPS <= gbps <= MAX_BANDWIDTH_GBPS:  # also NaN
            return
        with self._lock:
            previous = rates.get(backend)
            rates[backend] = (
                gbps
                if previous is None
                else previous + BANDWIDTH_ALPHA * (gbps - previous)
            )

    def oom_failures(self, backend: str) -> LoadFailures | None:
        """`backend`'s recent out-of-memory load failures (None: none seen)."""
        return self._oom.get(backend)

    @property
    def oom_backends(self) -> Mapping[str, LoadFailures]:
        """Live view of the backends with out-of-memory load failures."""
        return self._oom

    def add_waiting(self, backend: str, model: str) -> None:
        """Count one more request waiting in (backend, model)'s fleet queue."""
        key = (backend, model)
        with self._lock:
            self._waiting[key] = self._waiting.get(key, 0) + 1

    def remove_waiting(self, backend: str, model: str) -> None:
        """Count one request as no longer waiting there (never below 0)."""
        key = (backend, model)
        with self._lock:
            count = self._waiting.get(key, 0) - 1
            if count > 0:
                self._waiting[key] = count
            else:
                self._waiting.pop(key, None)

    @property
    def waiting_by_model(self) -> Mapping[tuple[str, str], int]:
        """Live view of requests waiting per (backend, model)."""
        return self._waiting

    def queue_depth(self, backend: str, model: str) -> int:
        """Requests in flight plus waiting for `model` on `backend`.

        A backend that reports its own load (a relay worker: every serving
        process's requests, or its busy slots) counts at least that many in
        flight, whatever model they are for: they hold its memory and slots.
        """
        key = (backend, model)
        waiting = self._waiting.get(key, 0)
        here = self._in_flight_models.get(key, 0) + waiting
        reported = self._reported.get(backend)
        return here if reported is None else max(here, reported + waiting)

    def mark_hot(self, backend: str, model: str) -> None:
        """Record that `backend` has `model` loaded as of now.

        Called when a request for it is sent there (the backend loads the
        model for it) and when the backend answers for it.
        """
        with self._lock:
            self._served_at[(backend, model)] = self.wall_clock()
            self._marked.setdefault(backend, set()).add(model)

    def mark_evicted(self, backend: str, model: str) -> None:
        """Record that `backend` is expected to have unloaded `model` as of now."""
        with self._lock:
            self._evicted_at[(backend, model)] = self.wall_clock()

    def served_at(self, backend: str, model: str) -> float | None:
        """Wall-clock time `model` was last marked loaded on `backend` (None: never)."""
        return self._served_at.get((backend, model))

    def marked_models(self, backend: str) -> frozenset[str]:
        """The models ever marked loaded on `backend` (``mark_hot``)."""
        return frozenset(self._marked.get(backend, ()))

    def evicted_at(self, backend: str, model: str) -> float | None:
        """Wall-clock time `model` was last expected unloaded from `backend`."""
        return self._evicted_at.get((backend, model))

    def served_ago(self, backend: str, model: str) -> float | None:
        """Seconds since `model` was last marked loaded on `backend` (None: never)."""
        served = self._served_at.get((backend, model))
        return None if served is None else self.wall_clock() - served

    def latency_p75_ms(self, backend: str, model: str) -> float | None:
        """The p75 latency of (backend, model), once it has enough samples."""
        window = self._model_latency.get((backend, model))
        if window is None or len(window) < MIN_LATENCY_SAMPLES:
            return None
        return window.p75

    def trend(self, backend: str) -> Trend:
        """Whether `backend` is freeing up or getting busier over the last minute."""
        tracker = self._trends.get(backend)
        if tracker is None:
            return Trend.STABLE
        return tracker.read(self.clock())

    def _trend_of(self, backend: str) -> TrendTracker:
        tracker = self._trends.get(backend)
        if tracker is None:
            tracker = self._trends[backend] = TrendTracker(self.clock())
        return tracker

    def _move_reported(self, backend: str, by: int) -> None:
        """Our own request began or ended there: the backend's count moved too
        (until its next report says; call with the lock held)."""
        reported = self._reported.get(backend)
        if reported is not None:
            self._reported[backend] = max(reported + by, 0)

    def _track_load(self, backend: str) -> None:
        """Feed the trend the new in-flight count (call with the lock held)."""
        self._trend_of(backend).set_load(self.clock(), self._in_flight[backend])

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


class LatencyWindow:
    """The last LATENCY_WINDOW latencies of one (backend, model) and their p75.

    A sliding window rather than an all-time sketch: a backend that got faster
    (more GPUs, a smaller quantisation) is judged by how it answers now. The
    p75 is recomputed on each sample (sorting 100 floats, off the decision).
    """

    __slots__ = ("_samples", "p75")

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.p75 = 0.0

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, latency_ms: float) -> None:
        """Add one sample, dropping the oldest past the window."""
        self._samples.append(latency_ms)
        ordered = sorted(self._samples)
        self.p75 = ordered[(len(ordered) - 1) * 3 // 4]


class TrendTracker:
    """A short (10 s) and a long (60 s) view of one backend's load and latency.

    Load is the in-flight count, a step function: both averages decay towards
    it with their time constant. Latency averages are per sample. When the
    short view of either is above the long one, the backend is getting busier
    (availability falling); below, freeing up (rising).
    """

    __slots__ = ("_at", "_fast", "_lat_at", "_lat_fast", "_lat_slow", "_level", "_slow")

    def __init__(self, now: float) -> None:
        self._fast = self._slow = self._level = 0.0
        self._at = now
        self._lat_fast: float | None = None
        self._lat_slow: float | None = None
        self._lat_at = now

    def set_load(self, now: float, level: int) -> None:
        """Record that the in-flight count became `level` at `now`."""
        self._fast, self._slow = self._decayed(now)
        self._level = float(level)
        self._at = now

    def observe_latency(self, now: float, latency_ms: float) -> None:
        """Fold one latency sample into both averages."""
        if self._lat_fast is None or self._lat_slow is None:
            self._lat_fast = self._lat_slow = latency_ms
        else:
            self._lat_fast += 0.5 * (latency_ms - self._lat_fast)
            self._lat_slow += 0.1 * (latency_ms - self._lat_slow)
        self._lat_at = now

    def read(self, now: float) -> Trend:
        """The trend at `now` (falling wins when load and latency disagree)."""
        fast, slow = self._decayed(now)
        delta = fast - slow
        ratio = 1.0
        if (
            self._lat_fast is not None
            and self._lat_slow
            and now - self._lat_at <= TREND_SLOW_SECONDS
        ):
            ratio = self._lat_fast / self._lat_slow
        if delta > TREND_LOAD_DELTA or ratio > TREND_LATENCY_RATIO:
            return Trend.FALLING
        if delta < -TREND_LOAD_DELTA or ratio < 1 / TREND_LATENCY_RATIO:
            return Trend.RISING
        return Trend.STABLE

    def _decayed(self, now: float) -> tuple[float, float]:
        elapsed = max(now - self._at, 0.0)
        level = self._level
        fast = level + (self._fast - level) * math.exp(-elapsed / TREND_FAST_SECONDS)
        slow = level + (self._slow - level) * math.exp(-elapsed / TREND_SLOW_SECONDS)
        return fast, slow
