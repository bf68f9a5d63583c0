"""Usage events that wait out a long outage on disk, not in memory.

A serving process hands its usage events on about once a second (to the
database in the embedded default, to Redis in production). While that fails,
they wait in the process's buffer; past ``keep_in_memory`` events the
background task moves the oldest ones to this process's spill file, an
append-only file of JSON lines (one batch per line, fsynced once per spill)
in ``NEXUS_USAGE_SPILL_DIR``. Once handing on works again, the task replays
the file batch by batch through the same path as live events; the database
write is idempotent by event id, so a batch replayed twice (a crash between
writing it and noting it written) is counted once. The file is emptied when
everything in it is handed on.

Each process holds an exclusive lock (``flock``) on its own file. A file
nobody holds belongs to a process that died with events in it: the next
process to open its spill adopts it and replays it too. Nothing here runs on
the request path: the gateway's task calls it through a worker thread, and
a cancelled task (a shutdown) waits for that thread before it ends, so the
shutdown's last spill never touches the file beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

from usage.buffer import UsageBuffer, UsageItem, decode_events, encode_events

logger = logging.getLogger(__name__)

SPILL_BATCH = 1000
_SUFFIX = ".jsonl"

_T = TypeVar("_T")


@dataclass(slots=True)
class _Queued:
    path: Path
    handle: IO[bytes]
    offset: int = 0
    own: bool = False


class UsageSpill:
    """This process's spill file, plus orphans it adopted (see the module)."""

    def __init__(self, directory: Path, *, keep_in_memory: int) -> None:
        self.directory = directory
        self.keep_in_memory = keep_in_memory
        self.spilled_total = 0  # events written to disk since start
        self.replayed_total = 0
        # Whether the files may hold events not handed on yet (kept in memory,
        # so that an idle tick costs no system call).
        self.pending = False
        self._queue: list[_Queued] = []
        self._own: _Queued | None = None

    # Files -----------------------------------------------------------------

    def open(self) -> None:
        """Create and lock this process's file; adopt files no process holds."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.directory.glob(f"*{_SUFFIX}")):
            handle = path.open("r+b")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.close()  # a live process's own file
                continue
            if path.stat().st_size == 0:
                path.unlink()
                handle.close()
                continue
            logger.info("Adopting usage events left in %s by a stopped process", path)
            self._queue.append(_Queued(path, handle))
            self.pending = True
        path = self.directory / f"{os.getpid()}-{uuid.uuid4().hex[:8]}{_SUFFIX}"
        handle = path.open("w+b")
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._own = _Queued(path, handle, own=True)
        self._queue.append(self._own)

    def close(self) -> None:
        """Release the files; an empty own file is removed, a full one kept."""
        for queued in self._queue:
            with contextlib.suppress(OSError):
                if queued.handle.seek(0, os.SEEK_END) <= queued.offset:
                    queued.path.unlink()
            queued.handle.close()
        self._queue = []
        self._own = None

    # Spilling (while handing on fails) ---------------------------------------

    def spill(self, buffer: UsageBuffer, keep: int | None = None) -> int:
        """Move the buffer's oldest events to disk, keeping `keep` in memory.

        `keep` defaults to ``keep_in_memory``; returns how many moved.
        """
        own = self._own
        excess = len(buffer) - (self.keep_in_memory if keep is None else keep)
        if own is None or excess <= 0:
            return 0
        events = buffer.drain(excess)  # the oldest
        try:
            handle = own.handle
            handle.seek(0, os.SEEK_END)
            for start in range(0, len(events), SPILL_BATCH):
                handle.write(encode_events(events[start : start + SPILL_BATCH]) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        except OSError:
            buffer.requeue(events)
            raise
        self.spilled_total += len(events)
        self.pending = True
        return len(events)

    # Replaying (once handing on works again) ----------------------------------

    @property
    def has_events(self) -> bool:
        return any(
            queued.handle.seek(0, os.SEEK_END) > queued.offset for queued in self._queue
        )

    def read_batch(self) -> tuple[list[UsageItem], int]:
        """Return the next spilled batch and where it ends ([] at the end)."""
        for queued in self._queue:
            handle = queued.handle
            handle.seek(queued.offset)
            line = handle.readline()
            if not line:
                continue
            if not line.endswith(b"\n"):  # a write cut short by a crash
                logger.error("Dropped a torn usage batch at the end of %s", queued.path)
                return [], handle.seek(0, os.SEEK_END)
            try:
                return decode_events(line), queued.offset + len(line)
            except (KeyError, TypeError, ValueError, json.JSONDecodeError):
                logger.exception("Dropped an unreadable usage batch in %s", queued.path)
                return [], queued.offset + len(line)
        return [], 0

    def commit(self, end: int) -> None:
        """Note the batch from read_batch() as handed on."""
        for queued in list(self._queue):
            handle = queued.handle
            size = handle.seek(0, os.SEEK_END)
            if size <= queued.offset:
                continue
            queued.offset = end
            if end >= size:
                self._finish(queued)
            return

    def _finish(self, queued: _Queued) -> None:
        if queued.own:
            queued.handle.truncate(0)
            queued.offset = 0
            return
        self._queue.remove(queued)
        queued.path.unlink(missing_ok=True)
        queued.handle.close()


async def finish_before_cancel(call: Awaitable[_T]) -> _T:
    """Await `call`; if cancelled meanwhile, wait for it to end, then raise.

    For work in a thread, which a cancel cannot stop: raised at once, the
    cancel would let its canceller (a shutdown) use the buffer and the spill
    file while the thread still does. The thread's own outcome is then
    dropped: the cancel is what the caller sees.
    """
    future = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            # Cancelled again (the loop closing): the thread still runs.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([future])
        if not future.cancelled():
            future.exception()  # retrieved, not raised: the cancel is
        raise


async def spill_excess(spill: UsageSpill | None, buffer: UsageBuffer) -> None:
    """After a failed hand-on: move what is over the memory share to disk."""
    if spill is None or len(buffer) <= spill.keep_in_memory:
        return
    try:
        moved = await finish_before_cancel(asyncio.to_thread(spill.spill, buffer))
    except OSError:
        logger.exception("Could not spill usage events to %s", spill.directory)
        return
    if moved:
        logger.warning(
            "Usage hand-on failing: %d events spilled to %s (%d so far)",
            moved,
            spill.directory,
            spill.spilled_total,
        )


async def replay_spilled(
    spill: UsageSpill | None,
    deliver: Callable[[list[UsageItem]], Awaitable[object]],
    *,
    max_batches: int = 20,
) -> int:
    """After a good hand-on: hand on up to `max_batches` spilled batches.

    A batch is noted as done only after `deliver` returned; an error from it
    stops the replay (the batch stays for the next time) and is raised.
    """
    if spill is None:
        return 0
    replayed = 0
    for _ in range(max_batches):
        events, end = await finish_before_cancel(asyncio.to_thread(spill.read_batch))
        if not end:
            spill.pending = False
            break
        if events:
            await deliver(events)
        await finish_before_cancel(asyncio.to_thread(spill.commit, end))
        replayed += len(events)
    if replayed:
        spill.replayed_total += replayed
        logger.info(
            "Replayed %d spilled usage events (%d in all)",
            replayed,
            spill.replayed_total,
        )
    return replayed
