"""Keep this process's router snapshot current without touching the request path.

Each serving process holds one immutable snapshot. Two background tasks watch
for changes: a listener on the Channels group where committed changes are
announced, and a periodic check of the persisted version that repairs lost
announcements (and is the only channel between processes in the embedded
default, whose channel layer is in-memory). The same check rebuilds a
snapshot past its ``expires_at`` (a backend's health result went stale, so
the data changed meaning without a new version) and takes a *lower* version
as it is: the database was restored from a backup or reset. A rebuild runs in a worker thread;
bursts of announcements coalesce into as few rebuilds as possible, and the new
snapshot replaces the old one with a single reference assignment, so requests in
flight keep the snapshot they started with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from channels.db import database_sync_to_async

from nexus_lib.groups import listen_to_group
from nexus_lib.service import TaskService, periodic
from routing.versioning import CONFIG_GROUP, read_config_version

logger = logging.getLogger(__name__)


class Versioned(Protocol):
    @property
    def version(self) -> int: ...


S = TypeVar("S", bound=Versioned)


class SnapshotHolder(Generic[S]):
    """The current snapshot of one process, and the tasks that refresh it.

    A service (nexus_lib.service): ``start()`` runs the announcement listener
    and the periodic version check, ``stop()`` ends them and any rebuild.
    """

    name = "snapshots"

    def __init__(
        self,
        build: Callable[[], S],
        *,
        poll_interval: float = 1.0,
        read_version: Callable[[], int] = read_config_version,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._build = build
        self._read_version = read_version
        self.poll_interval = poll_interval
        self._snapshot: S | None = None
        self._wanted = 0
        self._rebuilding: asyncio.Task[None] | None = None
        self._refreshers = (
            TaskService("snapshot-listen", self._listen),
            periodic(
                "snapshot-poll",
                lambda: self.poll_interval,
                self._poll,
                error="Checking the config version failed",
                log=logger.warning,
            ),
        )
        self.rebuilds = 0
        # Called with each snapshot once it is the one routed with.
        self.on_install: Callable[[S], None] = _ignore

    @property
    def snapshot(self) -> S:
        """The snapshot to route with; built synchronously on first use."""
        snapshot = self._snapshot
        if snapshot is None:
            snapshot = self.load()
        return snapshot

    def peek(self) -> S | None:
        """The snapshot held now, without building one."""
        return self._snapshot

    async def current(self) -> S:
        """The snapshot to route with, from async code (built on first use)."""
        snapshot = self._snapshot
        if snapshot is None:
            snapshot = await database_sync_to_async(self.load)()
        return snapshot

    def forget(self) -> None:
        """Drop the snapshot so that its next use rebuilds it from the database."""
        self._snapshot = None
        self._wanted = 0

    def load(self) -> S:
        """Build the snapshot now (sync code only: start-up, commands, tests)."""
        snapshot = self._build()
        self._install(snapshot)
        return snapshot

    def _install(self, snapshot: S) -> None:
        current = self._snapshot
        if current is None or snapshot.version >= current.version:
            self._snapshot = snapshot
            self.rebuilds += 1
            _log_version(current, snapshot)
            self.on_install(snapshot)

    def start(self) -> None:
        """Start the refresh tasks on the running loop."""
        for refresher in self._refreshers:
            refresher.start()

    async def stop(self) -> None:
        """Stop the refresh tasks and any rebuild under way."""
        rebuilding = [self._rebuilding] if self._rebuilding else []
        for task in rebuilding:
            task.cancel()
        await asyncio.gather(
            *(refresher.stop() for refresher in self._refreshers),
            *rebuilding,
            return_exceptions=True,
        )

    def request_version(self, version: int) -> None:
        """Note that `version` exists; rebuild unless we already have it."""
        current = self._snapshot
        if current is not None and version <= current.version:
            return
        self._wanted = max(self._wanted, version)
        if self._rebuilding is None or self._rebuilding.done():
            self._rebuilding = asyncio.get_running_loop().create_task(self._rebuild())

    async def catch_up(self, version: int) -> None:
        """Rebuild if `version` is newer than the snapshot held; wait for it.

        For a change this process made and must serve at once (a model that
        Ollama model management just pulled); the rebuild is shielded, so a
        caller that stops waiting leaves it to finish.
        """
        self.request_version(version)
        rebuilding = self._rebuilding
        if rebuilding is not None and not rebuilding.done():
            await asyncio.shield(rebuilding)

    async def _rebuild(self) -> None:
        while True:
            target = self._wanted
            try:
                snapshot = await database_sync_to_async(self._build)()
            except Exception:
                logger.exception("Rebuilding the router snapshot failed; will retry")
                await asyncio.sleep(self.poll_interval)
                continue
            self._install(snapshot)
            # Stop when what we built covers every version heard of meanwhile; a
            # build that saw less than it was asked for (a replica lagging, a
            # reset database) is left to the next periodic check.
            if self._wanted <= snapshot.version or self._wanted == target:
                return

    async def _poll(self) -> None:
        await self.check(await database_sync_to_async(self._read_version)())

    async def check(self, version: int) -> None:
        """Act on the persisted version: rebuild if it moved, or if due anyway."""
        current = self._snapshot
        if current is None or version > current.version:
            self.request_version(version)
            return
        expires_at: float | None = getattr(current, "expires_at", None)
        lower = version < current.version
        if lower or (expires_at is not None and self._clock() >= expires_at):
            if lower:
                logger.warning(
                    "The configuration version went down (%d -> %d): the database "
                    "was restored or reset; reloading the configuration",
                    current.version,
                    version,
                )
            if self._rebuilding is not None and not self._rebuilding.done():
                return  # the next check sees what it built
            self._rebuilding = asyncio.get_running_loop().create_task(self._reload())

    async def _reload(self) -> None:
        """Build and install a snapshot whatever its version (see check())."""
        try:
            snapshot = await database_sync_to_async(self._build)()
        except Exception:
            logger.exception("Reloading the router snapshot failed; will retry")
            return
        current, self._snapshot = self._snapshot, snapshot
        self._wanted = snapshot.version
        self.rebuilds += 1
        _log_version(current, snapshot)
        self.on_install(snapshot)

    async def _listen(self) -> None:
        await listen_to_group(CONFIG_GROUP, self._on_announcement)

    def _on_announcement(self, message: dict[str, Any]) -> None:
        if message.get("type") == "config.changed":
            self.request_version(int(message["version"]))


def _ignore(snapshot: object) -> None:
    pass


def _log_version(current: Versioned | None, snapshot: Versioned) -> None:
    """One line when the configuration changes (not for same-version rebuilds)."""
    if current is not None and current.version != snapshot.version:
        logger.info(
            "Configuration version %d is live (was %d)",
            snapshot.version,
            current.version,
        )
