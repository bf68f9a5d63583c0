"""Passive failure detection: a circuit breaker fed by the proxy, per backend.

The proxy reports what it sees on the request path with ``record_failure()``
(connect error, timeout before the response head, 5xx, an invalid reply) and
``record_success()``, each with the client's key prefix; both are dictionary
updates, with no I/O, ORM or await. K failures within a window open the
backend's circuit for a cool-down (``NEXUS_BREAKER_*`` settings).

One key cannot open a circuit other keys depend on. The K failures open it
when they come from at least two keys, or from one key while no other key was
served by the backend within the window (a single tenant still has its
breaker); one key's failures while others are served are that key's input,
not the backend, and the key keeps getting the backend's own answers. A 5xx
that the next candidate repeats for the same request is the input's too: the
proxy reports both as ``suspect``, and suspect failures open a circuit only
with another key's failures among the K. A request the relay cannot carry
(not UTF-8, too large) is the client's 4xx and counts nothing.

Opening:

1. takes effect in this process at once: the open circuit is written into the
   gateway's ``LiveStats``, which the router reads, so the backend is skipped
   (reason ``circuit_open``) and left out of retries;
2. is announced to every other serving process on the Channels group
   ``BREAKER_GROUP`` from a background task; each process's gateway listens
   there and passes the news to ``on_message()``, which opens the circuit too;
3. is recorded in the database by a Celery task (``NEXUS_BREAKER_PERSIST``),
   queued from a worker thread: the backend turns unhealthy, the admin shows
   why, and health probes bring it back. This is also how the news reaches
   processes the channel layer cannot (the embedded default's in-memory layer).
   Not for an opening on one key's failures: each process judges that one by
   the keys it served itself (the announcement names the key), and the
   database's unhealthy mark would pause the backend for every key everywhere.

After a cool-down the circuit closes on its own. Until the backend succeeds
again it is on probation: a single failure reopens it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from channels.layers import get_channel_layer
from django.conf import settings

from nexus_lib.layer import run_on_layer
from routing.core import LiveStats

logger = logging.getLogger(__name__)

BREAKER_GROUP = "nexus.breaker"
PUBLISH_TIMEOUT = 5.0


class BreakerOpenedEvent(TypedDict):
    """The message sent to BREAKER_GROUP when a process opens a circuit."""

    type: str  # always "breaker.opened"
    backend: str
    cooldown: float  # seconds, relative: monotonic clocks differ between processes
    detail: str
    origin: str  # the sending breaker, which ignores its own messages
    # The one key whose failures opened it (absent: several keys' failures).
    key: NotRequired[str]


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """K failures within `window` seconds open a circuit for `cooldown` seconds."""

    failures: int = 5
    window: float = 10.0
    cooldown: float = 30.0
    persist: bool = True

    @classmethod
    def from_settings(cls) -> BreakerSettings:
        """The rules configured with the NEXUS_BREAKER_* settings."""
        return cls(
            failures=settings.NEXUS_BREAKER_FAILURES,
            window=settings.NEXUS_BREAKER_WINDOW,
            cooldown=settings.NEXUS_BREAKER_COOLDOWN,
            persist=settings.NEXUS_BREAKER_PERSIST,
        )


class CircuitBreaker:
    """Per-backend circuit breakers of one process, shared with its router.

    ``stats`` is the LiveStats the router reads; ``config`` the rules. A
    service (nexus_lib.service) only for its stop: announcements under way are
    sent before the process exits.
    """

    name = "breaker"

    def __init__(self, *, stats: LiveStats, config: BreakerSettings) -> None:
        self.stats = stats
        self.config = config
        self.origin = uuid.uuid4().hex
        self._lock = threading.Lock()
        # The last K failures per backend: (clock(), key prefix, suspect).
        self._recent: dict[str, deque[tuple[float, str, bool]]] = {}
        # Per backend, the last two distinct keys it served and when:
        # (key, time, other key or None, time). Enough to tell whether a key
        # other than any given one was served lately, in constant memory.
        self._served: dict[str, tuple[str, float, str | None, float]] = {}
        # Opened and not yet seen succeeding: one failure reopens these.
        self._probation: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        # Called with the backend's name whenever this process opens a circuit.
        self.on_open: Callable[[str], None] = _ignore

    # The proxy's side: no I/O, no ORM, no await.

    def is_open(self, backend_name: str) -> bool:
        """Return whether traffic to the backend is paused (a dict lookup)."""
        return self.stats.is_circuit_open(backend_name)

    def record_success(self, backend_name: str, key: str = "") -> None:
        """Note a good answer for `key`: forget recent failures, end probation."""
        now = self.stats.clock()
        served = self._served.get(backend_name)
        if served is None:
            self._served[backend_name] = (key, now, None, 0.0)
        elif served[0] == key:
            self._served[backend_name] = (key, now, served[2], served[3])
        else:
            self._served[backend_name] = (key, now, served[0], served[1])
        if backend_name in self._recent or backend_name in self._probation:
            with self._lock:
                self._recent.pop(backend_name, None)
                self._probation.discard(backend_name)

    def record_failure(
        self, backend_name: str, key: str = "", *, suspect: bool = False
    ) -> None:
        """Note a failure of `key`'s request; open the circuit on the K-th
        within the window, unless all K are this key's and one of them is
        `suspect` (maybe the input's) or the backend served other keys."""
        config = self.config
        stats = self.stats
        now = stats.clock()
        with self._lock:
            if stats.is_circuit_open(backend_name):
                return
            recent = self._recent.get(backend_name)
            if recent is None:
                recent = self._recent[backend_name] = deque(maxlen=config.failures)
            recent.append((now, key, suspect))
            if backend_name in self._probation:
                detail = "failed again right after a circuit-breaker cool-down"
                one_key: str | None = key
            else:
                if len(recent) < config.failures or recent[0][0] <= now - config.window:
                    return
                one_key = key if all(k == key for _, k, _ in recent) else None
                suspect = any(s for _, _, s in recent)
                detail = (
                    f"{len(recent)} failures within {config.window:g} s seen by "
                    "the gateway"
                )
            if one_key is not None:
                if suspect or self._served_other(
                    backend_name, one_key, now - config.window
                ):
                    return  # that key's input, not the backend
                detail += f", all of one key's requests ({one_key or 'no key'})"
            self._open(backend_name, config.cooldown)
        self.on_open(backend_name)
        logger.warning(
            "Circuit breaker opened for backend %s for %g s: %s",
            backend_name,
            config.cooldown,
            detail,
        )
        event: BreakerOpenedEvent = {
            "type": "breaker.opened",
            "backend": backend_name,
            "cooldown": config.cooldown,
            "detail": detail,
            "origin": self.origin,
        }
        if one_key is not None:
            event["key"] = one_key
        self._announce(event)

    def _served_other(self, backend_name: str, key: str, since: float) -> bool:
        """Whether the backend served a key other than `key` after `since`."""
        served = self._served.get(backend_name)
        if served is None:
            return False
        last, at, before, before_at = served
        if last != key:
            return at > since
        return before is not None and before_at > since

    def _open(self, backend_name: str, cooldown: float) -> None:
        stats = self.stats
        stats.open_circuit(backend_name, stats.clock() + cooldown)
        self._recent.pop(backend_name, None)
        self._probation.add(backend_name)

    def open_remotely(self, event: BreakerOpenedEvent) -> None:
        """Apply another process's opening here (without announcing it again)."""
        if event["origin"] == self.origin:
            return
        cooldown = float(event["cooldown"])
        if not 0 < cooldown <= 86_400:
            return
        backend_name, key = str(event["backend"]), event.get("key")
        since = self.stats.clock() - self.config.window
        with self._lock:
            if key is not None and self._served_other(backend_name, str(key), since):
                return  # one key's failures there; other keys are served here
            self._open(backend_name, cooldown)

    # Announcing, off the request path.

    def _announce(self, event: BreakerOpenedEvent) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # Called from sync code (a thread, a command): it may wait for I/O.
            try:
                run_on_layer(lambda: self._publish(event))
            except TimeoutError:
                logger.warning("Could not announce a circuit opening", exc_info=True)
            return
        task = loop.create_task(self._publish(event))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish(self, event: BreakerOpenedEvent) -> None:
        layer = get_channel_layer()
        if layer is not None:
            try:
                async with asyncio.timeout(PUBLISH_TIMEOUT):
                    await layer.group_send(BREAKER_GROUP, event)
            except Exception:
                logger.warning("Could not announce a circuit opening", exc_info=True)
        if self.config.persist and "key" not in event:
            await asyncio.to_thread(_queue_persist, event["backend"], event["detail"])

    async def drain(self) -> None:
        """Wait for pending announcements (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def start(self) -> None:
        """Nothing to start: announcements run as circuits open."""

    async def stop(self) -> None:
        """Wait for pending announcements (shutdown)."""
        await self.drain()

    def on_message(self, message: dict[str, Any]) -> None:
        """Handle a message of BREAKER_GROUP (another process opened a circuit)."""
        if message.get("type") == "breaker.opened":
            try:
                self.open_remotely(message)  # type: ignore[arg-type]
            except (KeyError, TypeError, ValueError):
                logger.warning("Ignoring a malformed breaker message: %r", message)


def _ignore(backend_name: str) -> None:
    pass


def _queue_persist(backend_name: str, detail: str) -> None:
    """Queue the Celery task that marks the backend unhealthy (a worker thread)."""
    # Imported here, in the worker thread, when a circuit first opens: the
    # proxy imports this module, and the task's module loads Celery and the
    # ORM, which nothing on the request path may load.
    from backends.tasks import persist_breaker_opening

    try:
        persist_breaker_opening.delay(backend_name, detail)
    except Exception:
        logger.warning(
            "Could not queue recording the circuit opening of %s",
            backend_name,
            exc_info=True,
        )
