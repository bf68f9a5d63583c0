"""The relay workers connected to this process, as their heartbeats say.

Every pong (a newer worker's; ``nexus_worker.protocol.BackendState``) carries
what the worker's local model server reports: the models it has loaded with
their memory, context window and keep_alive, the memory it may fill and its
parallel slots. They land here, in memory, and reach the database only

* when they change what the router reads (a model loaded or unloaded, its
  memory, the worker's memory or slots; a keep_alive that moved by
  ``EXPIRY_SLACK``): at the next ``take_changes()``, all changed workers in
  one write, stored exactly as a health round stores a direct backend's
  probe (``backends.workers.record_worker_states``), so the fleet score
  reads them from the same fields;
* and, for liveness, every ``NEXUS_RELAY_SEEN_WRITE_SECONDS`` for all of this
  process's workers together (``backends.workers.see_workers``).

So a heartbeat costs no database work: 1,000 workers pinged every 5 s make
200 pongs a second, which used to be 200 database writes a second.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from backends.vocabulary import EXPIRY_SLACK, LoadedModel, WorkerState
from nexus_worker import protocol

# A keep_alive computed again from a worker's relative "expires in" differs
# by the time its pong took: a move back by less than this is that, not news.
EXPIRY_JITTER_SECONDS = 5.0
_SLACK_SECONDS = EXPIRY_SLACK.total_seconds()


@dataclass(frozen=True, slots=True)
class _View:
    """What the database keeps of a worker's state (expiries apart)."""

    loaded: tuple[tuple[str, int | None, int | None], ...] | None
    memory_bytes: int | None
    capacity: int | None
    # Model name -> wall-clock expiry (None: never, or not said).
    expiries: dict[str, float | None] = field(compare=False)

    def differs_from(self, written: _View | None) -> bool:
        """Whether the database must hear of this view (see the module doc)."""
        if written is None or self != written:
            return True
        for name, expiry in self.expiries.items():
            old = written.expiries.get(name)
            if expiry is None or old is None:
                if expiry != old:
                    return True
            elif expiry - old >= _SLACK_SECONDS or old - expiry > EXPIRY_JITTER_SECONDS:
                return True
        return False


@dataclass(slots=True)
class _Entry:
    channel: str
    max_concurrency: int
    on_lost: Callable[[], Awaitable[None]]
    view: _View | None = None
    written: _View | None = None


class WorkerRegistry:
    """This process's workers and their last reported state (see the module doc)."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._workers: dict[int, _Entry] = {}
        self._changed: set[int] = set()

    def __len__(self) -> int:
        return len(self._workers)

    def join(
        self,
        worker_id: int,
        channel: str,
        max_concurrency: int,
        on_lost: Callable[[], Awaitable[None]],
        state: protocol.BackendState | None,
    ) -> None:
        """A worker registered here; `on_lost` closes its socket when the
        database says it may not stay (revoked, or connected elsewhere)."""
        self._workers[worker_id] = _Entry(channel, max_concurrency, on_lost)
        self.note(worker_id, state)

    def leave(self, worker_id: int, channel: str) -> None:
        """The worker's socket here closed (a newer one may have joined since)."""
        entry = self._workers.get(worker_id)
        if entry is not None and entry.channel == channel:
            del self._workers[worker_id]
            self._changed.discard(worker_id)

    def note(self, worker_id: int, state: protocol.BackendState | None) -> None:
        """A heartbeat's state (None: an older worker, which says nothing)."""
        entry = self._workers.get(worker_id)
        if entry is None or state is None:
            return
        view = self._view(entry, state)
        entry.view = view
        if view.differs_from(entry.written):
            self._changed.add(worker_id)
        else:
            self._changed.discard(worker_id)

    def rewrite(self, worker_id: int) -> None:
        """Write the worker's state again at the next ``take_changes()`` (its
        models changed: a model it has loaded may have a row only now)."""
        entry = self._workers.get(worker_id)
        if entry is not None and entry.view is not None:
            entry.written = None
            self._changed.add(worker_id)

    def take_changes(self) -> dict[int, WorkerState]:
        """The states the database has not heard yet, counted as written."""
        changes: dict[int, WorkerState] = {}
        for worker_id in self._changed:
            entry = self._workers.get(worker_id)
            if entry is None or entry.view is None:
                continue
            entry.written = entry.view
            changes[worker_id] = _state_of(entry.view)
        self._changed.clear()
        return changes

    def channels(self) -> dict[int, str]:
        """Worker id -> the channel of its consumer here, for every worker."""
        return {worker_id: entry.channel for worker_id, entry in self._workers.items()}

    async def lose(self, worker_ids: set[int]) -> None:
        """Close the sockets of workers that may not stay."""
        for worker_id in worker_ids:
            entry = self._workers.pop(worker_id, None)
            if entry is not None:
                await entry.on_lost()

    def _view(self, entry: _Entry, state: protocol.BackendState) -> _View:
        now = self.clock()
        before = entry.view.expiries if entry.view is not None else {}
        expiries: dict[str, float | None] = {}
        loaded = None
        if state.loaded is not None:
            for model in state.loaded:
                expiry = None if model.expires_in is None else now + model.expires_in
                old = before.get(model.name)
                if expiry is not None and old is not None and abs(expiry - old) < 1.0:
                    expiry = old  # the same expiry, read again
                expiries[model.name] = expiry
            loaded = tuple(
                (model.name, model.vram_bytes, model.context_length)
                for model in state.loaded
            )
        capacity = None
        if state.slots:
            capacity = min(entry.max_concurrency, state.slots)
        return _View(loaded, state.memory_bytes, capacity, expiries)


_GB = 1e9


def _state_of(view: _View) -> WorkerState:
    details = {
        name: LoadedModel(
            vram_bytes=vram,
            context_length=context,
            expires_at=_moment(view.expiries.get(name)),
        )
        for name, vram, context in view.loaded or ()
    }
    return WorkerState(
        loaded=None if view.loaded is None else frozenset(details),
        details=details,
        memory_gb=None if view.memory_bytes is None else view.memory_bytes / _GB,
        max_concurrency=view.capacity,
    )


def _moment(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, tz=UTC)
