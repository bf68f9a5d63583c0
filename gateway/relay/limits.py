"""What one relay worker may cost a serving process: rates and throttles.

A worker credential is trusted to serve, not to spend the process: each
serving process bounds, with token buckets,

* per credential, the frames and bytes a worker sends (``FrameMeter``): over
  the rate its socket is not read until the bucket refills (back-pressure:
  the worker's sends wait, the process's memory does not grow), and a worker
  still over after ``throttle_seconds`` with no request of ours to answer
  (nothing it sends is wanted) is disconnected (4029); one that is answering
  requests is only slowed, however busy;
* per credential, how often it may connect and register, and how often its
  ``models_update`` is applied (``CredentialGate``): a register over the rate
  is refused (4029) before any database work, a models_update over it is
  held and the latest one applied when the bucket allows;
* per source address, failed authentications (``AuthThrottle``): after
  ``auth_failures`` in a minute the address is refused without a secret being
  checked, for a period that doubles while it keeps failing, and the log
  gets one line per address per minute with the count.

All of it is per process (a worker's connections land on one process at a
time; with N processes, N times the rates at most) and bounded in memory:
the tables forget idle entries and never hold more than ``MAX_ENTRIES``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings

from backends.workers import SECRET_SCHEME, hash_secret
from gateway.relay.churn import ConfigChurn
from nexus_worker import protocol

logger = logging.getLogger(__name__)

MAX_ENTRIES = 10_000
# Failed authentications are counted over this window (seconds), and each
# address gets at most one log line per window.
AUTH_WINDOW = 60.0
AUTH_BLOCK_MAX = 900.0
# Log lines about failed authentications, all addresses together, per window.
AUTH_LOG_LINES = 20


@dataclass(frozen=True, slots=True)
class RelayLimits:
    """The rates a worker is held to (``NEXUS_RELAY_*`` settings)."""

    frames_per_second: float = 5000.0
    bytes_per_second: float = 8 * 1024 * 1024
    throttle_seconds: float = 10.0
    reconnects_per_minute: float = 6.0
    reconnect_burst: int = 5
    model_updates_per_minute: float = 6.0
    model_update_burst: int = 3
    auth_failures: int = 5
    config_coalesce_seconds: float = 1.0

    @classmethod
    def from_settings(cls) -> RelayLimits:
        return cls(
            frames_per_second=settings.NEXUS_RELAY_FRAMES_PER_SECOND,
            bytes_per_second=settings.NEXUS_RELAY_BYTES_PER_SECOND,
            throttle_seconds=settings.NEXUS_RELAY_THROTTLE_SECONDS,
            reconnects_per_minute=settings.NEXUS_RELAY_RECONNECTS_PER_MINUTE,
            model_updates_per_minute=settings.NEXUS_RELAY_MODEL_UPDATES_PER_MINUTE,
            auth_failures=settings.NEXUS_RELAY_AUTH_FAILURES,
            config_coalesce_seconds=settings.NEXUS_RELAY_CONFIG_COALESCE_SECONDS,
        )

    @property
    def frame_burst(self) -> float:
        return max(2 * self.frames_per_second, 100.0)

    @property
    def byte_burst(self) -> float:
        # A frame of the largest size always fits in a full bucket.
        return max(2 * self.bytes_per_second, float(protocol.MAX_FRAME_BYTES))


class TokenBucket:
    """``rate`` tokens a second, up to ``burst``; taking more leaves a debt."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def refill(self, now: float) -> float:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        return self.tokens

    def take(self, amount: float, now: float) -> float:
        """Take `amount`; return the seconds until the bucket is out of debt."""
        self.tokens = self.refill(now) - amount
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def try_take(self, now: float, amount: float = 1.0) -> float:
        """Take `amount` if there is that much; else take nothing and return
        the seconds until there is (0.0: taken)."""
        tokens = self.refill(now)
        if tokens >= amount:
            self.tokens = tokens - amount
            return 0.0
        return (amount - tokens) / self.rate

    def is_full(self, now: float) -> bool:
        return self.refill(now) >= self.burst


class FrameMeter:
    """One connection's frames and bytes (see the module docstring)."""

    __slots__ = ("_bytes", "_frames", "limits", "over_since")

    def __init__(self, limits: RelayLimits, now: float) -> None:
        self.limits = limits
        self._frames = TokenBucket(limits.frames_per_second, limits.frame_burst, now)
        self._bytes = TokenBucket(limits.bytes_per_second, limits.byte_burst, now)
        # When the worker went over the rate without coming back under since.
        self.over_since: float | None = None

    def is_idle(self, now: float) -> bool:
        return self._frames.is_full(now) and self._bytes.is_full(now)

    def charge(self, size: int, now: float) -> float:
        """Count one frame of `size`; return how long to wait before reading
        on (0.0: the worker is within its rates)."""
        wait = max(self._frames.take(1, now), self._bytes.take(size, now))
        if wait <= 0:
            self.over_since = None
            return 0.0
        if self.over_since is None:
            self.over_since = now
        return wait

    def is_over_too_long(self, now: float, wait: float) -> bool:
        """Whether the worker, waiting `wait` more, will have been over its
        rates for longer than ``throttle_seconds`` on end."""
        since = self.over_since
        return since is not None and now - since + wait > self.limits.throttle_seconds


class CredentialGate:
    """Connects and models_updates per worker credential (token buckets)."""

    def __init__(self, rate_per_minute: float, burst: int) -> None:
        self.rate = rate_per_minute / 60.0
        self.burst = float(burst)
        self._buckets: dict[str, TokenBucket] = {}

    def admit(self, key: str, now: float) -> float:
        """Take a token for `key`; return 0.0, or the seconds until one is due."""
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_ENTRIES:
                self._forget_idle(now)
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now)
        return bucket.try_take(now)

    def _forget_idle(self, now: float) -> None:
        for key in [k for k, b in self._buckets.items() if b.is_full(now)]:
            del self._buckets[key]
        while len(self._buckets) >= MAX_ENTRIES:  # all busy: the oldest go
            del self._buckets[next(iter(self._buckets))]


class _Address:
    __slots__ = ("block", "blocked_until", "failures", "logged_at", "unlogged")

    def __init__(self) -> None:
        self.failures: list[float] = []
        self.blocked_until = 0.0
        self.block = 0.0  # the last block's length: the next one doubles it
        self.logged_at = -AUTH_WINDOW
        self.unlogged = 0  # failures and refusals since the last log line


class AuthThrottle:
    """Failed worker authentications per source address (module docstring)."""

    def __init__(
        self,
        failures: int,
        base_block: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures = failures
        self.base_block = base_block
        self._clock = clock
        self._addresses: dict[str, _Address] = {}
        self._log_window = -AUTH_WINDOW
        self._log_lines = 0
        self._unlogged_elsewhere = 0

    def blocked_for(self, address: str) -> float:
        """Seconds this address is still refused without a check (0.0: none)."""
        entry = self._addresses.get(address)
        if entry is None:
            return 0.0
        now = self._clock()
        left = entry.blocked_until - now
        if left <= 0:
            return 0.0
        entry.unlogged += 1
        self._log(address, entry, now, left)
        return left

    def failed(self, address: str) -> float:
        """Count a failed authentication; return the seconds the address is
        now blocked for (0.0: not blocked)."""
        now = self._clock()
        entry = self._addresses.get(address)
        if entry is None:
            if len(self._addresses) >= MAX_ENTRIES:
                self._forget_idle(now)
            entry = self._addresses[address] = _Address()
        entry.failures = [t for t in entry.failures if now - t < AUTH_WINDOW]
        entry.failures.append(now)
        entry.unlogged += 1
        left = 0.0
        if len(entry.failures) >= self.failures:
            # Each block doubles the last, unless it ended long ago.
            recent = now - entry.blocked_until < AUTH_BLOCK_MAX
            entry.block = min(
                AUTH_BLOCK_MAX,
                2 * entry.block if recent and entry.block else self.base_block,
            )
            entry.blocked_until = now + entry.block
            entry.failures.clear()
            left = entry.block
        # The first block of a series is worth its own line.
        self._log(address, entry, now, left, force=left == self.base_block)
        return left

    def _log(
        self,
        address: str,
        entry: _Address,
        now: float,
        blocked: float,
        force: bool = False,
    ) -> None:
        """At most one line per address per window (and one when it is first
        blocked), AUTH_LOG_LINES in all."""
        if now - entry.logged_at < AUTH_WINDOW and not force:
            return
        if now - self._log_window >= AUTH_WINDOW:
            self._log_window, self._log_lines = now, 0
        if self._log_lines >= AUTH_LOG_LINES:
            self._unlogged_elsewhere += entry.unlogged
            entry.unlogged = 0
            entry.logged_at = now
            return
        self._log_lines += 1
        entry.logged_at = now
        count, entry.unlogged = entry.unlogged, 0
        others, self._unlogged_elsewhere = self._unlogged_elsewhere, 0
        logger.warning(
            "Relay worker refused (bad or revoked secret) from %s: %d since "
            "the last line%s%s",
            address,
            count,
            f"; refused without a check for {blocked:.0f} s" if blocked else "",
            f" (and {others} from other addresses)" if others else "",
        )

    def _forget_idle(self, now: float) -> None:
        idle = [
            key
            for key, entry in self._addresses.items()
            if entry.blocked_until <= now
            and not any(now - t < AUTH_WINDOW for t in entry.failures)
        ]
        for key in idle:
            del self._addresses[key]
        while len(self._addresses) >= MAX_ENTRIES:
            del self._addresses[next(iter(self._addresses))]


class RelayGuard:
    """This process's relay limits and the tables behind them (one per
    gateway, handed to every worker's consumer)."""

    def __init__(self, limits: RelayLimits | None = None) -> None:
        self.limits = limits = limits or RelayLimits.from_settings()
        self.connects = CredentialGate(
            limits.reconnects_per_minute, limits.reconnect_burst
        )
        self.model_updates = CredentialGate(
            limits.model_updates_per_minute, limits.model_update_burst
        )
        self.auth = AuthThrottle(limits.auth_failures)
        self.churn = ConfigChurn(limits.config_coalesce_seconds)
        # Refused reconnects, all credentials together.
        self.refusal_log = LogBudget()
        self._meters: dict[int, FrameMeter] = {}

    def refusal(self, address: str, secret: str) -> int:
        """The close code for a connection refused before its secret is
        checked (0: go on): its address keeps failing to authenticate
        (AUTH_THROTTLED), or its credential reconnects too often
        (RATE_LIMITED; logged, at most 10 lines a minute)."""
        if self.auth.blocked_for(address) > 0:
            return protocol.CloseCode.AUTH_THROTTLED
        if not secret.startswith(SECRET_SCHEME) or len(secret) > 200:
            return 0  # refused by the check, counted as a failure
        now = time.monotonic()
        wait = self.connects.admit(hash_secret(secret), now)
        if wait <= 0:
            return 0
        held = self.refusal_log.allow(now)
        if held is not None:
            logger.warning(
                "Relay worker from %s reconnects too often: refused, next in %.0f s%s",
                address,
                wait,
                f" ({held} more refused)" if held else "",
            )
        return protocol.CloseCode.RATE_LIMITED

    def frame_meter(self, worker_id: int) -> FrameMeter:
        """The worker's meter: one per credential, so that a reconnect starts
        with the debt (and the time over) of the connection before."""
        now = time.monotonic()
        meter = self._meters.get(worker_id)
        if meter is None:
            if len(self._meters) >= MAX_ENTRIES:
                for key in [k for k, m in self._meters.items() if m.is_idle(now)]:
                    del self._meters[key]
                while len(self._meters) >= MAX_ENTRIES:
                    del self._meters[next(iter(self._meters))]
            meter = self._meters[worker_id] = FrameMeter(self.limits, now)
        return meter


class LogBudget:
    """At most `lines` log lines per minute; counts the ones it held back."""

    __slots__ = ("held", "lines", "spent", "window")

    def __init__(self, lines: int = 10) -> None:
        self.lines = lines
        self.window = -60.0
        self.spent = 0
        self.held = 0

    def allow(self, now: float) -> int | None:
        """None: do not log; else log, mentioning this many held back."""
        if now - self.window >= 60.0:
            self.window, self.spent = now, 0
        if self.spent >= self.lines:
            self.held += 1
            return None
        self.spent += 1
        held, self.held = self.held, 0
        return held
