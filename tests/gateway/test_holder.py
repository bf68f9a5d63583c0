"""The per-process snapshot holder: coalesced rebuilds, atomic swaps, repair."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest
from channels.layers import get_channel_layer

from gateway.holder import SnapshotHolder
from routing.versioning import CONFIG_GROUP


@dataclass(frozen=True)
class FakeSnapshot:
    version: int
    expires_at: float | None = None


class FakeSource:
    """A stand-in for the database: a version and a count of builds."""

    def __init__(self, version: int = 1, build_delay: float = 0.0) -> None:
        self.version = version
        self.expires_at: float | None = None
        self.builds = 0
        self.failures_left = 0
        self.build_delay = build_delay
        self._lock = threading.Lock()

    def build(self) -> FakeSnapshot:
        with self._lock:
            self.builds += 1
            if self.failures_left:
                self.failures_left -= 1
                raise RuntimeError("database went away")
        if self.build_delay:
            threading.Event().wait(self.build_delay)
        return FakeSnapshot(self.version, self.expires_at)

    def read_version(self) -> int:
        return self.version


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.01)


async def test_a_burst_of_announcements_coalesces_into_few_rebuilds() -> None:
    source = FakeSource(version=1, build_delay=0.05)
    holder = SnapshotHolder(source.build, read_version=source.read_version)
    holder.load()
    source.version = 50
    for version in range(2, 51):
        holder.request_version(version)
    await _wait_for(lambda: holder.snapshot.version == 50)
    assert source.builds <= 3  # the initial load plus at most two rebuilds


async def test_requests_in_flight_keep_the_snapshot_they_started_with() -> None:
    source = FakeSource(version=1)
    holder = SnapshotHolder(source.build, read_version=source.read_version)
    in_flight = holder.load()
    source.version = 2
    holder.request_version(2)
    await _wait_for(lambda: holder.snapshot.version == 2)
    assert in_flight.version == 1  # untouched object, not mutated in place
    assert holder.snapshot is not in_flight


async def test_known_versions_do_not_trigger_a_rebuild() -> None:
    source = FakeSource(version=3)
    holder = SnapshotHolder(source.build, read_version=source.read_version)
    holder.load()
    holder.request_version(3)
    holder.request_version(2)
    await asyncio.sleep(0.05)
    assert source.builds == 1


async def test_a_failed_rebuild_is_retried() -> None:
    source = FakeSource(version=1)
    holder = SnapshotHolder(
        source.build, read_version=source.read_version, poll_interval=0.05
    )
    holder.load()
    source.version = 2
    source.failures_left = 2
    holder.request_version(2)
    await _wait_for(lambda: holder.snapshot.version == 2)
    assert source.builds == 4


async def test_periodic_check_repairs_a_missed_announcement() -> None:
    source = FakeSource(version=1)
    holder = SnapshotHolder(
        source.build, read_version=source.read_version, poll_interval=0.05
    )
    holder.load()
    holder.start()
    try:
        source.version = 7  # changed elsewhere; no announcement reaches us
        await _wait_for(lambda: holder.snapshot.version == 7, timeout=2)
    finally:
        await holder.stop()


async def test_announcement_on_the_channel_layer_triggers_a_rebuild() -> None:
    source = FakeSource(version=1)
    # A poll interval far beyond the test's patience: only the broadcast can work.
    holder = SnapshotHolder(
        source.build, read_version=source.read_version, poll_interval=3600
    )
    holder.load()
    holder.start()
    try:
        layer = get_channel_layer()
        source.version = 2
        # The listener joins the group asynchronously; announce until it hears.
        for _ in range(100):
            await layer.group_send(
                CONFIG_GROUP, {"type": "config.changed", "version": 2}
            )
            if holder.snapshot.version == 2:
                break
            await asyncio.sleep(0.05)
        assert holder.snapshot.version == 2
    finally:
        await holder.stop()


@pytest.mark.parametrize("poll_interval", [0.05])
async def test_stop_cancels_every_background_task(poll_interval: float) -> None:
    source = FakeSource()
    holder = SnapshotHolder(
        source.build, read_version=source.read_version, poll_interval=poll_interval
    )
    holder.load()
    holder.start()
    await holder.stop()
    leftovers = [t for t in asyncio.all_tasks() if t.get_name().startswith("snapshot-")]
    assert leftovers == []


async def test_a_restored_database_with_a_lower_version_is_picked_up() -> None:
    source = FakeSource(version=40)
    holder = SnapshotHolder(
        source.build, read_version=source.read_version, poll_interval=0.05
    )
    holder.load()
    holder.start()
    try:
        source.version = 12  # a backup restored: the counter went back
        await _wait_for(lambda: holder.snapshot.version == 12, timeout=2)
        source.version = 13  # and changes after the restore count again
        await _wait_for(lambda: holder.snapshot.version == 13, timeout=2)
    finally:
        await holder.stop()


async def test_an_expired_snapshot_is_rebuilt_at_the_same_version() -> None:
    now = [1000.0]
    source = FakeSource(version=5)
    source.expires_at = 1010.0
    holder = SnapshotHolder(
        source.build,
        read_version=source.read_version,
        poll_interval=0.05,
        clock=lambda: now[0],
    )
    holder.load()
    holder.start()
    try:
        await asyncio.sleep(0.2)
        assert source.builds == 1  # not expired yet
        source.expires_at = None
        now[0] = 1010.0
        # (The build counts itself before the holder installs what it built.)
        await _wait_for(lambda: holder.snapshot.expires_at is None, timeout=2)
        assert source.builds == 2
        await asyncio.sleep(0.2)
        assert source.builds == 2  # nothing expires any more
    finally:
        await holder.stop()


async def test_a_new_configuration_version_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = FakeSource(version=1)
    holder = SnapshotHolder(source.build, read_version=source.read_version)
    holder.load()
    source.version = 2
    with caplog.at_level("INFO", logger="gateway.holder"):
        holder.request_version(2)
        await _wait_for(lambda: holder.snapshot.version == 2)
        holder.load()  # a same-version rebuild says nothing
    assert [r.getMessage() for r in caplog.records] == [
        "Configuration version 2 is live (was 1)"
    ]
