"""What the Redis limiter writes unanswered: settles, reserve returns, releases.

They are queued and written together on the loop's next turn, after the answer
that caused them, and always ahead of the limiter's next command (in its
write); the settles of a key holding a reserve are summed for up to
COALESCE_SECONDS first. Each goes after ``CLIENT REPLY SKIP``, and none can be
refused for a script Redis lost (a settle is an ``EVAL`` of its source, a
release a plain ``ZREM``, see ``usage.limits.redis_limiter``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from usage.limits.commands import KeyCommands
from usage.limits.resp import RespConnection, encode, encode_parts

# The settles of a key holding a reserve (far from its limits, so nobody is
# refused for a hold kept a moment longer) are summed and written together at
# most this long after the first of them.
COALESCE_SECONDS = 0.05

# Written before each settle and release (see PendingWrites.take).
NO_REPLY = encode(("CLIENT", "REPLY", "SKIP"))
_PING = encode(("PING",))


class PendingWrites:
    """The limiter's writes that nobody waits for, until they are written."""

    def __init__(self, on_failure: Callable[[BaseException], None]) -> None:
        self.redis: RespConnection | None = None  # the limiter's, while started
        self._failed = on_failure
        # Backend leases released here whose release is not yet written to
        # Redis: the next request for that backend takes one over (see
        # RedisLimiter.acquire_backend).
        self.released: dict[str, list[str]] = {}  # backend set key -> leases
        # Settles and releases not written yet: an encoded settle, or a
        # backend's (set key, lease) whose release is encoded when written
        # (unless a request took the slot over meanwhile).
        self.pending: list[bytes | tuple[str, str]] = []
        self._flush_scheduled = False
        self.unsettled: list[KeyCommands] = []  # keys with summed settles
        self._coalescing: asyncio.TimerHandle | None = None
        # Settles or releases were written that no reply has confirmed yet.
        self.unconfirmed = False
        self._tasks: list[asyncio.Task[Any]] = []  # settles being written

    def cancel(self) -> list[asyncio.Task[Any]]:
        """Stop writing on a timer; the writes under way, cancelled, to await."""
        if self._coalescing is not None:
            self._coalescing.cancel()
            self._coalescing = None
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        return tasks

    def coalesce(self, commands: KeyCommands) -> None:
        """Write the key's summed settles (``commands.unsettled``) soon."""
        self.unsettled.append(commands)
        if self._coalescing is None:
            self._coalescing = asyncio.get_running_loop().call_later(
                COALESCE_SECONDS, self._coalesced
            )

    def _coalesced(self) -> None:
        self._coalescing = None
        if self.unsettled:
            self._flush_soon()

    def queue(self, entry: bytes | tuple[str, str]) -> None:
        """Queue a settle or release; written on the loop's next turn (after
        the answer that caused it has gone out), or ahead of the next command
        this process sends, whichever comes first: in one write either way."""
        self.pending.append(entry)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self._flush_scheduled = False
        redis = self.redis
        if not (self.pending or self.unsettled) or redis is None:
            return
        if redis.is_open:
            self.unconfirmed = True
            if not redis.send_unanswered(self.take()):
                self._failed(RedisConnectionError("Redis connection lost"))
        else:  # (re)connect first, off the request path
            task = asyncio.get_running_loop().create_task(self.flush())
            self._tasks.append(task)
            task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[Any]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    def take(self) -> bytes:
        """Every pending settle and release, encoded to be written in one go.

        Each comes after ``CLIENT REPLY SKIP``: Redis runs it and answers
        nothing, so nothing has to be read back for it (one wake-up of this
        process less per request). Its outcome is not reported: a lost settle's
        holds are reconciled by beat, a lost release's lease expires.
        """
        pending, self.pending = self.pending, []
        commands: list[bytes] = []
        unsettled, self.unsettled = self.unsettled, []
        for summed in unsettled:
            sums, summed.unsettled = summed.unsettled, None
            assert sums is not None
            # TPM delta, "" (no lease), held and used tokens and nanos.
            commands += (
                NO_REPLY,
                summed.settle + encode_parts((sums[0], "", *sums[1:])),
            )
        for entry in pending:
            if isinstance(entry, tuple):
                key, lease = entry  # a backend lease's release (release_backend)
                released = self.released.get(key, [])
                if lease not in released:
                    continue  # taken over by a request since: nothing to free
                released.remove(lease)
                if not released:
                    del self.released[key]
                # A plain command: it cannot be refused for a missing script
                # (and so run after the acquire that needs the slot).
                entry = encode(("ZREM", key, lease))
            commands += (NO_REPLY, entry)
        return b"".join(commands)

    async def flush(self) -> None:
        """Write what is pending and wait until Redis has run it."""
        redis = self.redis
        if redis is None or not (self.pending or self.unsettled or self.unconfirmed):
            return
        try:
            await redis.open()
            self.unconfirmed = False
            # Answered once everything written before it has run.
            await redis.request(_PING, self.take())
        except (RedisError, OSError) as error:
            # Holds and leases expire or are reconciled; spend is recounted
            # from the usage tables by the reconciliation.
            self._failed(error)
            self._drop()

    def _drop(self) -> None:
        # Lost: holds are set right by the next renewal, spend is recounted
        # from the usage tables by the reconciliation.
        for commands in self.unsettled:
            commands.unsettled = None
        self.unsettled = []
        pending, self.pending = self.pending, []
        for entry in pending:
            if isinstance(entry, tuple):
                key, lease = entry
                released = self.released.get(key, [])
                if lease in released:
                    released.remove(lease)
                    if not released:
                        del self.released[key]
