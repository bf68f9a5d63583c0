"""Usage events wait out an outage on disk and are replayed once each.

The spill file itself (real files in a temporary directory), and, in
production mode, a serving process's Redis shipper through a Redis outage
made by cutting its connection (tests/tcp_cut.py): memory stays at the spill
threshold however long the outage, and every event arrives exactly once.
"""

from __future__ import annotations

import asyncio
import fcntl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import OperationalError, connections

import usage.spill
from tests.tcp_cut import TcpCut
from usage.buffer import UsageBuffer, UsageEvent
from usage.flush import DatabaseFlusher
from usage.models import UsageRecord
from usage.spill import UsageSpill, replay_spilled, spill_excess
from usage.stream import RedisShipper, clear_usage_stream, drain_usage_stream


def _event(index: int, tag: str = "spill") -> UsageEvent:
    return UsageEvent(
        request_id=f"{tag}-{index}",
        endpoint="chat",
        api_key_prefix="",
        backend="b",
        requested_model="m",
        served_model="m",
        prompt_tokens=1,
        completion_tokens=2,
        total_tokens=3,
        estimated=False,
        latency_ms=1.0,
        status=200,
        streamed=False,
    )


def _buffer(count: int, tag: str = "spill") -> UsageBuffer:
    buffer = UsageBuffer()
    for index in range(count):
        buffer.append(_event(index, tag))
    return buffer


async def _until(condition: Callable[[], object], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


def _redis_through_cut() -> tuple[TcpCut, str]:
    """A TcpCut in front of the test Redis, and the Redis URL through it."""
    redis_url = urlsplit(settings.REDIS_URL)
    cutter = TcpCut((redis_url.hostname or "127.0.0.1", redis_url.port or 6379))
    return cutter, redis_url._replace(netloc=f"127.0.0.1:{cutter.port}").geturl()


async def _arrived(prefix: str) -> int:
    """Usage rows whose request id starts with `prefix`, the stream drained first."""
    await sync_to_async(drain_usage_stream)()
    return await UsageRecord.objects.filter(request_id__startswith=prefix).acount()


async def _replay_all(spill: UsageSpill) -> list[UsageEvent]:
    delivered: list[UsageEvent] = []

    async def deliver(events: list[UsageEvent]) -> None:
        delivered.extend(events)

    while await replay_spilled(spill, deliver):
        pass
    return delivered


async def test_events_over_the_memory_share_go_to_disk_and_come_back(
    tmp_path: Path,
) -> None:
    spill = UsageSpill(tmp_path, keep_in_memory=100)
    spill.open()
    buffer = _buffer(2500)
    await spill_excess(spill, buffer)
    assert len(buffer) == 100
    assert [e.request_id for e in buffer.drain()] == [
        f"spill-{i}" for i in range(2400, 2500)
    ]  # the newest stay in memory
    delivered = await _replay_all(spill)
    assert [e.request_id for e in delivered] == [f"spill-{i}" for i in range(2400)]
    assert not spill.pending
    assert await _replay_all(spill) == []  # handed on once
    spill.close()
    assert list(tmp_path.iterdir()) == []  # an empty file is removed


async def test_a_failed_delivery_keeps_the_batch_for_next_time(tmp_path: Path) -> None:
    spill = UsageSpill(tmp_path, keep_in_memory=0)
    spill.open()
    spill.spill(_buffer(1500))

    async def failing(events: list[UsageEvent]) -> None:
        raise ConnectionError("still down")

    with pytest.raises(ConnectionError):
        await replay_spilled(spill, failing)
    assert len(await _replay_all(spill)) == 1500


async def test_a_stopped_process_file_is_adopted_by_the_next(tmp_path: Path) -> None:
    crashed = UsageSpill(tmp_path, keep_in_memory=0)
    crashed.open()
    crashed.spill(_buffer(300, "crashed"))
    # The process dies: its lock goes with it, its file stays.
    assert crashed._own is not None
    crashed._own.handle.close()
    alive = UsageSpill(tmp_path, keep_in_memory=0)
    alive.open()
    assert alive.pending
    delivered = await _replay_all(alive)
    assert {e.request_id for e in delivered} == {f"crashed-{i}" for i in range(300)}
    alive.close()
    assert list(tmp_path.iterdir()) == []


def test_a_live_process_file_is_left_alone(tmp_path: Path) -> None:
    first = UsageSpill(tmp_path, keep_in_memory=0)
    first.open()
    first.spill(_buffer(10))
    second = UsageSpill(tmp_path, keep_in_memory=0)
    second.open()
    assert not second.pending  # first holds its lock
    assert first._own is not None
    with pytest.raises(OSError):
        fcntl.flock(first._own.path.open("rb"), fcntl.LOCK_EX | fcntl.LOCK_NB)


async def test_a_torn_last_line_is_dropped_not_fatal(tmp_path: Path) -> None:
    spill = UsageSpill(tmp_path, keep_in_memory=0)
    spill.open()
    spill.spill(_buffer(5))
    assert spill._own is not None
    spill._own.handle.write(b'{"fields": ["request_id"], "ev')  # a crash mid-write
    spill._own.handle.flush()
    assert len(await _replay_all(spill)) == 5


async def test_a_cancelled_replay_ends_only_after_its_commit(tmp_path: Path) -> None:
    # A stop cancels the replay while its thread notes a batch as done (and
    # may empty the file). Were the cancel passed on at once, the stop's last
    # spill would append to the file beside that thread, which could truncate
    # the fresh lines away. The thread is held by a hook: nothing real makes
    # a truncate() slow on demand.
    spill = UsageSpill(tmp_path, keep_in_memory=0)
    spill.open()
    spill.spill(_buffer(10))
    entered, release, committed = (threading.Event() for _ in range(3))
    commit = spill.commit

    def held_commit(end: int) -> None:
        entered.set()
        release.wait(30)
        commit(end)
        committed.set()

    spill.commit = held_commit  # type: ignore[method-assign]
    delivered: list[UsageEvent] = []

    async def deliver(events: list[UsageEvent]) -> None:
        delivered.extend(events)

    replay = asyncio.create_task(replay_spilled(spill, deliver))
    await _until(entered.is_set, "the replay commits", 10)
    replay.cancel()
    # A cancel passed on at once ends the task within this; one that waits
    # for the thread does not, and ends once the commit is let through.
    done, _ = await asyncio.wait({replay}, timeout=0.5)
    release.set()
    assert not done
    with pytest.raises(asyncio.CancelledError):
        await replay
    assert committed.is_set()
    assert len(delivered) == 10
    spill.close()
    assert list(tmp_path.iterdir()) == []  # emptied, then removed: all handed on


@pytest.mark.skipif(not settings.REDIS_URL, reason="the Redis transport needs Redis")
@pytest.mark.django_db(transaction=True)
async def test_a_long_redis_outage_costs_no_memory_and_loses_nothing(
    tmp_path: Path,
) -> None:
    await sync_to_async(clear_usage_stream)()
    cutter, url = _redis_through_cut()
    buffer = UsageBuffer(maxlen=1000)
    spill = UsageSpill(tmp_path, keep_in_memory=100)
    shipper = RedisShipper(buffer, redis_url=url, interval=0.01, spill=spill)
    shipper.start()
    try:
        cutter.cut()
        # A long outage, compressed: 20 times the buffer's bound arrives.
        most_in_memory = 0
        for index in range(20_000):
            buffer.append(_event(index, "outage"))
            if index % 500 == 499:
                most_in_memory = max(most_in_memory, len(buffer))
                # Arrivals paced by the shipper's ticks (as requests are by
                # their own work): wait until it has spilled this batch.
                paced = time.monotonic() + 20
                while len(buffer) > 100:
                    assert time.monotonic() < paced, "events not spilled"
                    await asyncio.sleep(0.01)
        deadline = time.monotonic() + 20
        while len(buffer) > 100:
            assert time.monotonic() < deadline, "events not spilled"
            await asyncio.sleep(0.05)
        assert buffer.dropped_total == 0
        assert most_in_memory <= 1000
        assert spill.spilled_total >= 19_000
        cutter.restore()
        deadline = time.monotonic() + 60
        written = 0
        while written < 20_000:
            assert time.monotonic() < deadline, f"only {written} of 20000 arrived"
            await asyncio.sleep(0.2)
            written = await _arrived("outage-")
        assert written == 20_000  # and none twice (event ids are unique)
        assert not spill.pending
    finally:
        await shipper.stop()
        cutter.close()
        # The ORM's connection of sync_to_async's thread: closed, or the test
        # database cannot be dropped at the end of the session.
        await sync_to_async(connections.close_all)()


@pytest.mark.skipif(not settings.REDIS_URL, reason="the Redis transport needs Redis")
@pytest.mark.django_db(transaction=True)
async def test_events_arriving_while_a_shipment_fails_are_all_kept(
    tmp_path: Path,
) -> None:
    # Requests keep appending while a shipment is on its way to Redis. When it
    # fails, its events go back in front of those: none is pushed out of the
    # bounded buffer (the full production runs of the test above lost the
    # newest 100 of 20,000 this way).
    import redis

    await sync_to_async(clear_usage_stream)()
    cutter, url = _redis_through_cut()
    server = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    buffer = UsageBuffer(maxlen=1000)
    spill = UsageSpill(tmp_path, keep_in_memory=100)
    shipper = RedisShipper(buffer, redis_url=url, interval=0.01, spill=spill)
    shipper.start()
    try:
        # Redis holds every write (10 s at most: other xdist workers share
        # the server), so the shipment of these 600 stays on its way.
        server.client_pause(10_000, all=False)
        for index in range(600):
            buffer.append(_event(index, "in-flight"))
        await _until(lambda: not len(buffer), "the shipper took them", 10)
        for index in range(600, 1100):
            buffer.append(_event(index, "in-flight"))
        cutter.cut()  # the shipment fails
        server.client_unpause()
        await _until(
            lambda: spill.spilled_total and len(buffer) <= 100,
            "the failed shipment was spilled",
            20,
        )
        assert buffer.dropped_total == 0
        assert spill.spilled_total == 1000  # the 100 newest stay in memory
        cutter.restore()
        deadline = time.monotonic() + 30
        written = 0
        while written < 1100:
            assert time.monotonic() < deadline, f"only {written} of 1100 arrived"
            await asyncio.sleep(0.1)
            written = await _arrived("in-flight-")
        assert written == 1100
    finally:
        server.client_unpause()
        server.close()
        await shipper.stop()
        cutter.close()
        await sync_to_async(connections.close_all)()


class _Outage:
    """A hand-on outage for one transport, and the sink of a process start."""

    def __init__(self, transport: str, spill_dir: Path) -> None:
        self.transport = transport
        self.spill_dir = spill_dir
        self.cutter: TcpCut | None = None
        self.cut_url = ""

    def _failing_inserts(
        self, execute: Callable[..., Any], sql: str, *args: Any
    ) -> Any:
        if sql.lstrip().upper().startswith("INSERT") and "usagerecord" in sql:
            raise OperationalError("database is unreachable")
        return execute(sql, *args)

    async def begin(self) -> None:
        if self.transport == "redis":
            await sync_to_async(clear_usage_stream)()
            self.cutter, self.cut_url = _redis_through_cut()
            self.cutter.cut()
        else:
            # In the flusher's database thread: sync_to_async runs code there.
            await sync_to_async(self._fail_inserts)(True)

    async def end(self) -> None:
        if self.cutter is not None:
            self.cutter.close()
            self.cutter = None
        else:
            await sync_to_async(self._fail_inserts)(False)

    def _fail_inserts(self, on: bool) -> None:
        wrappers = connections["default"].execute_wrappers
        if self._failing_inserts in wrappers:
            wrappers.remove(self._failing_inserts)
        if on:
            wrappers.append(self._failing_inserts)

    def start(self, buffer: UsageBuffer) -> RedisShipper | DatabaseFlusher:
        """Start a sink over this directory (through the outage, if on)."""
        spill = UsageSpill(self.spill_dir, keep_in_memory=100)
        sink: RedisShipper | DatabaseFlusher
        if self.transport == "redis":
            url = self.cut_url if self.cutter is not None else settings.REDIS_URL
            sink = RedisShipper(buffer, redis_url=url, interval=0.01, spill=spill)
        else:
            sink = DatabaseFlusher(buffer, interval=0.01, spill=spill)
        sink.start()
        return sink

    async def count(self, prefix: str) -> int:
        if self.transport == "redis":
            return await _arrived(prefix)
        return await UsageRecord.objects.filter(request_id__startswith=prefix).acount()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("transport", ["database", "redis"])
async def test_a_stop_during_a_spill_keeps_every_event_for_the_next_start(
    transport: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sink is stopped (a shutdown during an outage) while its thread is
    # writing events it took from the buffer to the spill file. The stop must
    # wait for that write: its own last spill and close() beside it lost the
    # thread's events (a write to a closed file).
    if transport == "redis" and not settings.REDIS_URL:
        pytest.skip("the Redis transport needs Redis")

    # Nothing real holds a local disk write still for as long as a test needs
    # (a slow disk is a matter of luck): the spill thread is held here, after
    # it took its events from the buffer and before it writes them, as a slow
    # write() would hold it. Only that thread, and only its first batch.
    entered, release = threading.Event(), threading.Event()
    encode = usage.spill.encode_events

    def held_encode(events: list[UsageEvent]) -> bytes:
        in_thread = threading.current_thread() is not threading.main_thread()
        if in_thread and not entered.is_set():
            entered.set()
            release.wait(30)
        return encode(events)

    monkeypatch.setattr(usage.spill, "encode_events", held_encode)
    outage = _Outage(transport, tmp_path)
    await outage.begin()
    buffer = UsageBuffer(maxlen=1000)
    sink = outage.start(buffer)
    try:
        for index in range(500):
            buffer.append(_event(index, "stopped"))
        await _until(entered.is_set, "the sink spills", 10)
        assert len(buffer) == 100  # the thread holds the 400 oldest
        for index in range(500, 550):
            buffer.append(_event(index, "stopped"))  # arriving meanwhile
        stopping = asyncio.create_task(sink.stop())
        # A stop that does not wait for the thread is over within this; one
        # that waits is not, and goes on once the write is let through.
        await asyncio.wait({stopping}, timeout=1)
        release.set()
        await stopping
        assert len(buffer) == 0
    finally:
        release.set()
        await sink.stop()
        await outage.end()
    try:
        assert await outage.count("stopped-") == 0

        # The next process start, the outage over: the file is replayed.
        next_start = outage.start(UsageBuffer(maxlen=1000))
        try:
            replayed = next_start.spill
            assert replayed is not None
            await _until(lambda: not replayed.pending, "the file was replayed", 20)
        finally:
            await next_start.stop()
        written = await outage.count("stopped-")
        assert (written, replayed.replayed_total) == (550, 550)  # each once
    finally:
        await sync_to_async(connections.close_all)()
