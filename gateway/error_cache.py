"""The error cache: a backend that just refused a connection is skipped a while.

The seed's transient-error cache, beside the circuit breaker (gateway/breaker.py).
The breaker waits for K failures of any kind; a connection that cannot even be
made (refused, reset before an answer, a host name that does not resolve, a
connect timeout) says at once that the server is not there, so the next
requests should not each pay for finding out:

1. the proxy reports such a failure with ``connect_failed()`` (a dictionary
   update, no I/O); the backend goes into the gateway's ``LiveStats``
   (``fail_connection``) for ``NEXUS_ERROR_CACHE_SECONDS`` (10 s; 0 turns the
   cache off), and the router skips it for new requests (reason
   ``error_cached``, named by the route explain API) and forwarding skips it
   among retry targets. Requests already in flight there are not touched.
2. the failure is announced on the breaker's Channels group
   (``BREAKER_GROUP``, one listener per process), so that the other serving
   processes skip it too for the same time; the news is not persisted: a
   backend that stays down turns unhealthy through health probes and the
   breaker, as before.
3. after the time it is tried again by the next request routed there; a good
   answer from it also takes it out at once.

A model load that failed for want of memory (``out_of_memory()``, from the
proxy and the fleet's warm-ups) is noted in ``LiveStats`` the same way
(routing/core/capacity.py: repeated, it pauses the node's cold loads) and
announced on the same group, so every serving process pauses the node, and
the admin, served by any of them, shows it.

When every candidate of a model is in the cache, the router keeps the one that
failed longest ago rather than refuse the request untried: a server that came
back is found at once, and a model served only by one flaky backend still gets
each request tried (``routing.core.router``).

An HTTP error status is an answer from a live server and never goes into the
cache (the breaker counts it), and neither does a relay worker (its hub knows
whether it is connected).

``FailureLog`` logs upstream failures at most once per backend per minute,
with the reason; the next line says how many were left out meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, TypedDict

import aiohttp
from channels.layers import get_channel_layer

from gateway.breaker import BREAKER_GROUP, PUBLISH_TIMEOUT
from routing.core import BackendSpec, LiveStats
from routing.core.capacity import OutOfMemory, note_out_of_memory

logger = logging.getLogger(__name__)

# Failures of one backend logged at most once per this many seconds.
LOG_INTERVAL = 60.0
# An error of the socket itself before any answer: the server is not there.
_CONNECTION_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ETIMEDOUT,
    }
)


FAILED_EVENT = "error_cache.failed"
OUT_OF_MEMORY_EVENT = "error_cache.out_of_memory"
# An error's text kept with an out-of-memory announcement.
_MAX_DETAIL = 500


class ErrorCachedEvent(TypedDict):
    """The message sent to BREAKER_GROUP when a process caches a failure."""

    type: str  # FAILED_EVENT
    backend: str
    seconds: float  # relative: monotonic clocks differ between processes
    origin: str  # the sending cache, which ignores its own messages


class OutOfMemoryEvent(TypedDict):
    """The message sent to BREAKER_GROUP when a load failed for want of memory."""

    type: str  # OUT_OF_MEMORY_EVENT
    backend: str
    model: str
    detail: str
    used_gb: float | None
    total_gb: float | None
    origin: str


def is_connection_failure(error: BaseException) -> bool:
    """Whether `error` says the backend could not be reached at all.

    Refused, reset or aborted connections, unreachable hosts, unknown host
    names, TLS handshakes that failed and connect timeouts; not a timeout
    waiting for an answer, nor a server that closed a connection it had
    answered on.
    """
    if isinstance(error, aiohttp.ConnectionTimeoutError | aiohttp.ClientConnectorError):
        return True
    if isinstance(error, aiohttp.ServerDisconnectedError):
        # A pooled connection the server closed while idle: it is alive.
        return False
    return (
        isinstance(error, aiohttp.ClientOSError) and error.errno in _CONNECTION_ERRNOS
    )


def describe_failure(reason: str, error: BaseException | None) -> str:
    """`reason` with what the operating system said, for the log."""
    if isinstance(error, aiohttp.ClientConnectorDNSError):
        return f"{reason} (host name not found)"
    code = error.errno if isinstance(error, OSError) else None
    if code:
        return f"{reason} ({os.strerror(code).lower()})"
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return f"{reason} (connect timed out)"
    return reason


class FailureLog:
    """Log upstream failures at most once per backend per ``interval`` seconds.

    A failure inside the interval is counted, not logged; the next line logged
    for that backend says how many were left out. Memory: one entry per
    backend name the configuration has had.
    """

    def __init__(
        self,
        interval: float = LOG_INTERVAL,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.clock = clock
        # backend name -> (clock() of the last line logged, failures left out since)
        self._last: dict[str, tuple[float, int]] = {}

    def note(self, backend_name: str, reason: str) -> bool:
        """Count one failure of the backend; log it unless one was lately.

        Returns whether it was logged.
        """
        now = self.clock()
        last = self._last.get(backend_name)
        if last is not None and now - last[0] < self.interval:
            self._last[backend_name] = (last[0], last[1] + 1)
            return False
        self._last[backend_name] = (now, 0)
        left_out = last[1] if last is not None else 0
        if left_out:
            logger.warning(
                "Backend %s failed: %s (%d more failures in the %g s before "
                "were not logged)",
                backend_name,
                reason,
                left_out,
                self.interval,
            )
        else:
            logger.warning("Backend %s failed: %s", backend_name, reason)
        return True


class ErrorCache:
    """The error cache of one serving process (see the module docstring).

    A service (nexus_lib.service) only for its stop: announcements under way
    are sent before the process exits.
    """

    name = "error-cache"

    def __init__(
        self,
        *,
        stats: LiveStats,
        seconds: float,
        failures: FailureLog | None = None,
    ) -> None:
        self.stats = stats
        self.seconds = seconds
        self.failures = failures or FailureLog()
        self.origin = uuid.uuid4().hex
        self._background: set[asyncio.Task[None]] = set()

    # The proxy's side: no I/O, no ORM, no await.

    def is_cached(self, backend_name: str) -> bool:
        """Whether new requests skip the backend now (a dict lookup)."""
        return self.stats.connection_failed_at(backend_name) is not None

    def connect_failed(self, backend_name: str, error: BaseException) -> bool:
        """Note that reaching the backend failed with `error`.

        Caches the backend (and announces it) when `error` is a connection
        failure and the cache is on; returns whether it did so now.
        """
        if self.seconds <= 0 or not is_connection_failure(error):
            return False
        if not self.stats.fail_connection(
            backend_name, self.stats.clock() + self.seconds
        ):
            return False  # cached already: the first failure's deadline stands
        logger.info(
            "Backend %s skipped for %g s: a connection to it failed",
            backend_name,
            self.seconds,
        )
        self._announce(
            {
                "type": FAILED_EVENT,
                "backend": backend_name,
                "seconds": self.seconds,
                "origin": self.origin,
            }
        )
        return True

    def out_of_memory(self, backend: BackendSpec, model: str, oom: OutOfMemory) -> None:
        """`backend` could not load `model` for want of memory: note it here
        and in every other serving process (see the module docstring)."""
        used_gb, total_gb = note_out_of_memory(self.stats, backend, model, oom)
        self._announce(
            {
                "type": OUT_OF_MEMORY_EVENT,
                "backend": backend.name,
                "model": model,
                "detail": oom.detail[:_MAX_DETAIL],
                "used_gb": used_gb,
                "total_gb": total_gb,
                "origin": self.origin,
            }
        )

    def record_success(self, backend_name: str) -> None:
        """The backend answered: new requests may go there again at once."""
        self.stats.forget_connection_failure(backend_name)

    def note_failure(
        self, backend_name: str, reason: str, error: BaseException | None = None
    ) -> None:
        """Log an upstream failure (at most once per backend per minute)."""
        self.failures.note(backend_name, describe_failure(reason, error))

    # Other processes' failures.

    def on_message(self, message: dict[str, Any]) -> None:
        """Handle a message of BREAKER_GROUP (another process cached a
        failure, or saw a load fail for want of memory)."""
        if message.get("origin") == self.origin:
            return
        if message.get("type") == OUT_OF_MEMORY_EVENT:
            self._on_out_of_memory(message)
            return
        if message.get("type") != FAILED_EVENT or self.seconds <= 0:
            return
        try:
            backend_name = str(message["backend"])
            seconds = float(message["seconds"])
        except (KeyError, TypeError, ValueError):
            logger.warning("Ignoring a malformed error cache message: %r", message)
            return
        if 0 < seconds <= 3600:
            self.stats.fail_connection(backend_name, self.stats.clock() + seconds)

    def _on_out_of_memory(self, message: dict[str, Any]) -> None:
        backend, model, detail = (
            message.get(k) for k in ("backend", "model", "detail")
        )
        used_gb, total_gb = message.get("used_gb"), message.get("total_gb")
        if not (
            isinstance(backend, str)
            and isinstance(model, str)
            and isinstance(detail, str)
            and all(_is_gb(value) for value in (used_gb, total_gb))
        ):
            logger.warning("Ignoring a malformed out-of-memory message: %r", message)
            return
        self.stats.note_oom(
            backend, model, detail[:_MAX_DETAIL], used_gb=used_gb, total_gb=total_gb
        )
        self.stats.mark_evicted(backend, model)

    # Announcing, off the request path.

    def _announce(self, event: ErrorCachedEvent | OutOfMemoryEvent) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not serving (a test calling it from sync code)
        task = loop.create_task(self._publish(event))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish(self, event: ErrorCachedEvent | OutOfMemoryEvent) -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT):
                await layer.group_send(BREAKER_GROUP, event)
        except Exception:
            logger.warning("Could not announce a backend's failure", exc_info=True)

    def start(self) -> None:
        """Nothing to start: announcements run as failures happen."""

    async def stop(self) -> None:
        """Wait for pending announcements (shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


def _is_gb(value: object) -> bool:
    """None, or a plausible number of GB (a node of up to 1 PB)."""
    return value is None or (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and 0 <= value <= 1e6
    )
