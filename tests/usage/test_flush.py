from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import OperationalError, connection
from django.db.models import Sum

from tests.conftest import REPO_ROOT, server_env
from tests.factories import UsageEventFactory
from usage.buffer import UsageBuffer
from usage.flush import DatabaseFlusher, flush_usage
from usage.models import UsageRecord
from usage.stream import drain_usage_stream


@pytest.fixture
def buffer() -> UsageBuffer:
    """A serving process's buffer (each gateway owns one)."""
    return UsageBuffer(maxlen=100_000)


def _failing_inserts(message: str = "database is unreachable") -> Callable[..., Any]:
    def wrapper(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if sql.lstrip().upper().startswith("INSERT") and "usagerecord" in sql:
            raise OperationalError(message)
        return execute(sql, *args)

    return wrapper


@pytest.mark.django_db
def test_flush_writes_each_buffered_event_as_one_row(buffer: UsageBuffer) -> None:
    ok = UsageEventFactory(
        request_id="req-1",
        endpoint="completions",
        api_key_prefix="nx-12345678",
        backend="gpu-2",
        requested_model="gpt-4",
        served_model="llama3:70b",
        prompt_tokens=11,
        completion_tokens=7,
        total_tokens=18,
        estimated=True,
        latency_ms=250.5,
        streamed=True,
        created_at=1_790_000_000.25,
    )
    failed = UsageEventFactory(status=200, error="stream_interrupted")
    buffer.append(ok)
    buffer.append(failed)

    assert flush_usage(buffer) == 2

    assert len(buffer) == 0
    row = UsageRecord.objects.get(event_id=ok.event_id)
    assert (row.request_id, row.endpoint, row.api_key_prefix) == (
        "req-1",
        "completions",
        "nx-12345678",
    )
    assert (row.backend, row.requested_model, row.served_model) == (
        "gpu-2",
        "gpt-4",
        "llama3:70b",
    )
    assert (row.prompt_tokens, row.completion_tokens, row.total_tokens) == (11, 7, 18)
    assert row.estimated and row.streamed and not row.is_error
    assert row.latency_ms == 250.5
    assert row.created_at == datetime.fromtimestamp(1_790_000_000.25, tz=UTC)
    assert not row.rolled_up
    # A stream that broke after its first byte keeps status 200 but is an error.
    assert UsageRecord.objects.get(event_id=failed.event_id).is_error


@pytest.mark.django_db
def test_a_failed_write_puts_the_batch_back_and_loses_nothing(
    buffer: UsageBuffer,
) -> None:
    events = UsageEventFactory.build_batch(5)
    for event in events:
        buffer.append(event)

    with (
        connection.execute_wrapper(_failing_inserts()),
        pytest.raises(OperationalError),
    ):
        flush_usage(buffer, batch_size=2)

    assert [e.event_id for e in buffer.drain()] == [e.event_id for e in events]
    assert not UsageRecord.objects.exists()


@pytest.mark.django_db
def test_a_batch_failing_midway_keeps_earlier_batches_and_requeues_the_rest(
    buffer: UsageBuffer,
) -> None:
    events = UsageEventFactory.build_batch(5)
    for event in events:
        buffer.append(event)
    calls = 0

    def second_insert_fails(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        nonlocal calls
        if sql.lstrip().upper().startswith("INSERT"):
            calls += 1
            if calls == 2:
                raise OperationalError("connection reset")
        return execute(sql, *args)

    with (
        connection.execute_wrapper(second_insert_fails),
        pytest.raises(OperationalError),
    ):
        flush_usage(buffer, batch_size=2)
    assert UsageRecord.objects.count() == 2

    assert flush_usage(buffer) == 3
    assert set(UsageRecord.objects.values_list("event_id", flat=True)) == {
        e.event_id for e in events
    }


@pytest.mark.django_db
def test_events_arriving_while_a_write_fails_are_kept_behind_the_failed_batch() -> None:
    # The flusher writes from a database thread while requests keep appending:
    # the failed batch goes back in front of them and, although the bounded
    # buffer then holds more than its bound, none of them is pushed out.
    buffer = UsageBuffer(maxlen=1000)
    in_flight = UsageEventFactory.build_batch(600)
    meanwhile = UsageEventFactory.build_batch(500)
    for event in in_flight:
        buffer.append(event)

    def arrivals_then_failure(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if sql.lstrip().upper().startswith("INSERT") and "usagerecord" in sql:
            for event in meanwhile:
                buffer.append(event)
            raise OperationalError("connection reset")
        return execute(sql, *args)

    with (
        connection.execute_wrapper(arrivals_then_failure),
        pytest.raises(OperationalError),
    ):
        flush_usage(buffer)

    assert flush_usage(buffer) == 1100
    assert buffer.dropped_total == 0
    assert list(
        UsageRecord.objects.order_by("pk").values_list("event_id", flat=True)
    ) == [e.event_id for e in in_flight + meanwhile]


@pytest.mark.django_db
def test_retrying_a_flush_that_did_commit_writes_nothing_twice(
    buffer: UsageBuffer,
) -> None:
    # The ambiguous failure: rows committed, then the flush was told it failed
    # (lost acknowledgement) and the events went back into the buffer.
    events = UsageEventFactory.build_batch(4)
    for event in events:
        buffer.append(event)
    flush_usage(buffer)
    buffer.requeue(events)

    flush_usage(buffer)

    assert UsageRecord.objects.count() == 4
    assert len(buffer) == 0


@pytest.mark.django_db
def test_requests_sharing_a_client_request_id_are_each_counted(
    buffer: UsageBuffer,
) -> None:
    # X-Request-Id is chosen by the client and may repeat; each request used tokens.
    for _ in range(3):
        buffer.append(UsageEventFactory(request_id="client-chosen", total_tokens=9))

    flush_usage(buffer)

    assert UsageRecord.objects.filter(request_id="client-chosen").count() == 3
    assert UsageRecord.objects.aggregate(t=Sum("total_tokens"))["t"] == 27


@pytest.mark.django_db
def test_out_of_range_values_are_kept_within_the_columns_instead_of_failing(
    buffer: UsageBuffer,
) -> None:
    odd = UsageEventFactory(
        prompt_tokens=-5,
        completion_tokens=3,
        total_tokens=3,
        latency_ms=math.nan,
        served_model="m" * 300,
        request_id="r" * 200,
    )
    fine = UsageEventFactory()
    buffer.append(odd)
    buffer.append(fine)

    assert flush_usage(buffer) == 2

    row = UsageRecord.objects.get(event_id=odd.event_id)
    assert row.prompt_tokens == 0 and row.total_tokens == 3
    assert row.latency_ms == 0.0
    assert row.served_model == "m" * 200
    assert UsageRecord.objects.filter(event_id=fine.event_id).exists()


@pytest.mark.django_db
def test_a_malformed_event_is_dropped_without_blocking_the_others(
    buffer: UsageBuffer,
) -> None:
    broken = UsageEventFactory(created_at=math.nan)  # a proxy bug
    good = UsageEventFactory()
    buffer.append(broken)
    buffer.append(good)

    assert flush_usage(buffer) == 1

    assert len(buffer) == 0
    assert list(UsageRecord.objects.values_list("event_id", flat=True)) == [
        good.event_id
    ]


@pytest.mark.django_db
def test_flush_reports_events_the_full_buffer_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    small = UsageBuffer(maxlen=2)
    for event in UsageEventFactory.build_batch(3):
        small.append(event)

    assert flush_usage(small) == 2

    assert "dropped 1 events" in caplog.text
    assert small.dropped == 0  # reported once


@pytest.mark.django_db(transaction=True)
def test_concurrent_flushes_write_every_event_exactly_once(buffer: UsageBuffer) -> None:
    events = UsageEventFactory.build_batch(2000, total_tokens=3)
    produced = threading.Event()

    def produce() -> None:
        for event in events:
            buffer.append(event)
        produced.set()

    def flush_until_drained() -> None:
        try:
            while not produced.is_set() or len(buffer):
                flush_usage(buffer, batch_size=97)
        finally:
            connection.close()

    threads = [threading.Thread(target=flush_until_drained) for _ in range(4)]
    threads.append(threading.Thread(target=produce))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert UsageRecord.objects.count() == 2000
    assert UsageRecord.objects.aggregate(t=Sum("total_tokens"))["t"] == 6000


@pytest.fixture
async def _close_worker_connections() -> AsyncIterator[None]:
    """Close the connection of the thread database_sync_to_async runs code in."""
    yield

    def close() -> None:
        connection.close()  # resolved in the worker thread: its own connection

    await database_sync_to_async(close)()


@pytest.mark.usefixtures("_close_worker_connections")
@pytest.mark.django_db(transaction=True)
async def test_the_background_flusher_writes_soon_and_once_more_when_stopped(
    buffer: UsageBuffer,
) -> None:
    count = database_sync_to_async(UsageRecord.objects.count)
    flusher = DatabaseFlusher(buffer, interval=0.05)
    flusher.start()
    for event in UsageEventFactory.build_batch(3):
        buffer.append(event)
    async with asyncio.timeout(10):
        while await count() < 3:
            await asyncio.sleep(0.02)

    # Appended just before shutdown: the final flush on stop writes them.
    for event in UsageEventFactory.build_batch(2):
        buffer.append(event)
    await flusher.stop()

    assert await count() == 5


@pytest.mark.usefixtures("_close_worker_connections")
@pytest.mark.django_db(transaction=True)
async def test_the_process_flusher_runs_once_and_writes_everything_on_stop(
    buffer: UsageBuffer,
) -> None:
    flusher = DatabaseFlusher(buffer)
    flusher.start()
    assert [t.get_name() for t in asyncio.all_tasks()].count("usage-flusher") == 1
    for event in UsageEventFactory.build_batch(4):
        buffer.append(event)

    await flusher.stop()

    assert "usage-flusher" not in [t.get_name() for t in asyncio.all_tasks()]
    assert await database_sync_to_async(UsageRecord.objects.count)() == 4
    await flusher.stop()  # stopping twice is harmless


@pytest.mark.usefixtures("_close_worker_connections")
@pytest.mark.django_db(transaction=True)
async def test_the_background_flusher_survives_a_database_outage(
    buffer: UsageBuffer,
) -> None:
    count = database_sync_to_async(UsageRecord.objects.count)
    # The flusher's thread writes through its own connection; fail its inserts
    # from before the first flush.
    outage = _failing_inserts()
    from django.db import connections

    def install() -> None:
        connections["default"].execute_wrappers.append(outage)

    def remove() -> None:
        connections["default"].execute_wrappers.remove(outage)

    await database_sync_to_async(install)()
    flusher = DatabaseFlusher(buffer, interval=0.02)
    flusher.start()
    for event in UsageEventFactory.build_batch(3):
        buffer.append(event)
    await asyncio.sleep(0.2)
    assert await count() == 0
    # Between failed attempts every event is back in the buffer (an attempt may
    # be holding them at any given instant, so wait for a moment between two).
    async with asyncio.timeout(5):
        while len(buffer) != 3:
            await asyncio.sleep(0.001)
    await database_sync_to_async(remove)()

    async with asyncio.timeout(10):
        while await count() < 3:
            await asyncio.sleep(0.02)
    await flusher.stop()


@pytest.mark.usefixtures("_close_worker_connections")
@pytest.mark.django_db(transaction=True)
async def test_a_stop_during_a_failing_write_keeps_its_events_for_the_next_start(
    tmp_path: Path,
) -> None:
    # The flusher is stopped (a shutdown during a database outage) while its
    # database thread holds a batch it took from the buffer. The stop must
    # wait for that write: it found the buffer empty, closed the spill file,
    # and the batch came back to the buffer after it, to be lost at exit.
    from django.db import connections

    from usage.spill import UsageSpill

    # The outage as the other tests make it (inserts fail in the flusher's
    # thread), held until the test lets it fail: nothing real keeps a write
    # waiting for as long as the test needs, then fails it.
    entered, release = threading.Event(), threading.Event()

    def held_then_failing(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if sql.lstrip().upper().startswith("INSERT") and "usagerecord" in sql:
            entered.set()
            release.wait(30)
            raise OperationalError("database is unreachable")
        return execute(sql, *args)

    def install() -> None:
        connections["default"].execute_wrappers.append(held_then_failing)

    def remove() -> None:
        connections["default"].execute_wrappers.remove(held_then_failing)

    count = database_sync_to_async(
        UsageRecord.objects.filter(request_id__startswith="stopped-").count
    )
    await database_sync_to_async(install)()
    buffer = UsageBuffer(maxlen=1000)
    flusher = DatabaseFlusher(
        buffer, interval=0.02, spill=UsageSpill(tmp_path, keep_in_memory=100)
    )
    flusher.start()
    try:
        for index in range(300):
            buffer.append(UsageEventFactory.build(request_id=f"stopped-{index}"))
        async with asyncio.timeout(10):
            while not entered.is_set():
                await asyncio.sleep(0.01)
        assert len(buffer) == 0  # the thread holds all 300
        stopping = asyncio.create_task(flusher.stop())
        # A stop that does not wait for the thread is over within this; one
        # that waits is not, and goes on once the write has failed.
        await asyncio.wait({stopping}, timeout=1)
        release.set()
        await stopping
        assert len(buffer) == 0
    finally:
        release.set()
        await flusher.stop()
        await database_sync_to_async(remove)()
    assert await count() == 0

    # The next process start: the database is back, the file is replayed.
    spill = UsageSpill(tmp_path, keep_in_memory=100)
    next_start = DatabaseFlusher(UsageBuffer(maxlen=1000), interval=0.02, spill=spill)
    next_start.start()
    try:
        async with asyncio.timeout(20):
            while spill.pending:
                await asyncio.sleep(0.02)
    finally:
        await next_start.stop()
    assert (await count(), spill.replayed_total) == (300, 300)  # each once


EXIT_SCRIPT = """
import asyncio
from nexus_site.asgi import gateway  # the serving process's gateway
from tests.factories import UsageEventFactory

async def serve():
    gateway.start()
    for n in range(7):
        gateway.buffer.append(UsageEventFactory(request_id=f"exit-{n}", total_tokens=5))

asyncio.run(serve())
# No stop() here: the process ends, as a server without lifespan events does.
"""


@pytest.mark.django_db(transaction=True)
def test_a_graceful_exit_writes_what_the_buffer_still_holds() -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "--no-imports", "-c", EXIT_SCRIPT],
        check=False,
        cwd=REPO_ROOT,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr
    if settings.NEXUS_USAGE_TRANSPORT == "redis":
        drain_usage_stream()  # the process shipped them; the worker writes them
    rows = UsageRecord.objects.filter(request_id__startswith="exit-")
    assert rows.count() == 7
    assert rows.aggregate(t=Sum("total_tokens"))["t"] == 35
