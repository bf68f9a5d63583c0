from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.db.models import Sum
from django.utils import timezone

from tests.conftest import REPO_ROOT, server_env
from tests.factories import UsageRecordFactory
from usage.models import COUNTER_FIELDS, TokenUsage, UsageBucket, UsageRecord
from usage.rollup import roll_up_usage
from usage.tasks import prune_usage_records
from usage.tasks import roll_up_usage as roll_up_usage_task

EXACT_COUNTERS = tuple(name for name in COUNTER_FIELDS if name != "latency_ms_sum")


def _series_totals(model: type[Any], *extra: str) -> dict[tuple[Any, ...], dict]:
    rows = model.objects.values(
        *extra, "backend", "model", "api_key_prefix", *EXACT_COUNTERS
    )
    return {
        tuple(row[k] for k in (*extra, "backend", "model", "api_key_prefix")): {
            name: row[name] for name in EXACT_COUNTERS
        }
        for row in rows
    }


def _expected_from_records(
    records: list[dict[str, Any]], *, per_minute: bool = False
) -> dict[tuple[Any, ...], dict[str, int]]:
    """The aggregates computed independently, straight from the raw events."""
    expected: dict[tuple[Any, ...], Counter[str]] = defaultdict(Counter)
    for r in records:
        key: tuple[Any, ...] = (
            r["backend"],
            r["served_model"] or r["requested_model"],
            r["api_key_prefix"],
        )
        if per_minute:
            moment = datetime.fromtimestamp(r["created_at"], tz=UTC)
            key = (moment.replace(second=0, microsecond=0), *key)
        failed = bool(r["error"]) or r["status"] >= 400
        expected[key].update(
            requests=1,
            errors=int(failed),
            prompt_tokens=r["prompt_tokens"],
            completion_tokens=r["completion_tokens"],
            total_tokens=r["total_tokens"],
            estimated_requests=int(r["estimated"]),
            estimated_tokens=r["total_tokens"] if r["estimated"] else 0,
        )
    return {k: {n: v.get(n, 0) for n in EXACT_COUNTERS} for k, v in expected.items()}


@pytest.mark.django_db
def test_rollup_adds_records_to_series_totals_and_minute_buckets() -> None:
    minute = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    UsageRecordFactory(created_at=minute + timedelta(seconds=1), latency_ms=100)
    UsageRecordFactory(
        created_at=minute + timedelta(seconds=59),
        prompt_tokens=7,
        completion_tokens=0,
        total_tokens=7,
        estimated=True,
        latency_ms=300,
    )
    UsageRecordFactory(created_at=minute + timedelta(minutes=1), failed=True)
    # Failed before a model was chosen: counted under the model asked for.
    UsageRecordFactory(
        backend="", served_model="", requested_model="gpt-5", failed=True
    )

    assert roll_up_usage() == 4

    llama = TokenUsage.objects.get(backend="gpu-1", model="llama3:8b")
    assert (llama.requests, llama.errors) == (3, 1)
    assert (llama.prompt_tokens, llama.completion_tokens, llama.total_tokens) == (
        27,
        10,
        37,
    )
    assert (llama.estimated_requests, llama.estimated_tokens) == (1, 7)
    assert llama.api_key_prefix == "nx-aaaaaaaa"
    unserved = TokenUsage.objects.get(backend="", model="gpt-5")
    assert (unserved.requests, unserved.errors) == (1, 1)

    first = UsageBucket.objects.get(minute=minute, model="llama3:8b")
    assert (first.requests, first.total_tokens, first.estimated_tokens) == (2, 22, 7)
    assert first.latency_ms_avg == 200.0
    second = UsageBucket.objects.get(minute=minute + timedelta(minutes=1))
    assert (second.requests, second.errors) == (1, 1)
    assert not UsageRecord.objects.pending().exists()


@pytest.mark.django_db
def test_a_second_rollup_adds_only_new_records() -> None:
    UsageRecordFactory.create_batch(3, total_tokens=10)
    roll_up_usage()
    assert roll_up_usage() == 0
    UsageRecordFactory(total_tokens=5)

    assert roll_up_usage() == 1

    totals = TokenUsage.objects.get()
    assert (totals.requests, totals.total_tokens) == (4, 35)
    assert UsageBucket.objects.aggregate(t=Sum("total_tokens"))["t"] == 35


@pytest.mark.django_db
def test_small_batches_add_up_to_the_same_totals() -> None:
    for n in range(25):
        UsageRecordFactory(
            backend=f"gpu-{n % 3}",
            prompt_tokens=n,
            completion_tokens=1,
            total_tokens=n + 1,
        )

    assert roll_up_usage(batch_size=4) == 25

    assert TokenUsage.objects.aggregate(t=Sum("total_tokens"))["t"] == sum(range(1, 26))
    assert TokenUsage.objects.count() == 3


@pytest.mark.django_db
def test_a_rollup_that_dies_midway_counts_nothing_and_a_retry_counts_once() -> None:
    UsageRecordFactory.create_batch(6, total_tokens=10)

    def die_when_marking(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        # The aggregates were already raised in this transaction by now.
        if sql.lstrip().upper().startswith("UPDATE") and "usagerecord" in sql:
            raise OperationalError("server closed the connection unexpectedly")
        return execute(sql, *args)

    with (
        connection.execute_wrapper(die_when_marking),
        pytest.raises(OperationalError),
    ):
        roll_up_usage(batch_size=4)

    assert not TokenUsage.objects.exists()
    assert not UsageBucket.objects.exists()
    assert UsageRecord.objects.pending().count() == 6

    assert roll_up_usage(batch_size=4) == 6
    assert TokenUsage.objects.get().total_tokens == 60
    assert UsageBucket.objects.aggregate(t=Sum("total_tokens"))["t"] == 60


@pytest.mark.django_db
def test_pruning_records_keeps_pending_and_recent_ones(settings) -> None:
    settings.NEXUS_USAGE_RECORD_RETENTION_HOURS = 24
    old = timezone.now() - timedelta(hours=25)
    UsageRecordFactory(created_at=old, rolled=True)
    waiting = UsageRecordFactory(created_at=old)  # never dropped before rollup
    recent = UsageRecordFactory(rolled=True)

    assert prune_usage_records() == 1

    assert set(UsageRecord.objects.values_list("pk", flat=True)) == {
        waiting.pk,
        recent.pk,
    }


def test_beat_rolls_usage_up_every_ten_seconds_by_default(settings) -> None:
    entry = settings.CELERY_BEAT_SCHEDULE["roll-up-usage"]
    assert entry["task"] == roll_up_usage_task.name
    assert entry["schedule"] == 10.0
    assert "prune-usage-records" in settings.CELERY_BEAT_SCHEDULE


# --- Exactness across processes, concurrent rollups and a killed rollup ------

SERVING_SCRIPT = """
import atexit, json, sys
from usage.buffer import UsageBuffer, UsageEvent
from usage.flush import DatabaseFlusher, flush_usage

buffer = UsageBuffer()
atexit.register(DatabaseFlusher(buffer).flush_on_exit)  # as a gateway does
events = [UsageEvent(**fields) for fields in json.load(sys.stdin)]
# Flush as the background flusher does, a batch at a time; the last events are
# left for the exit flush of a graceful shutdown.
for start in range(0, len(events), 40):
    for event in events[start:start + 40]:
        buffer.append(event)
    if start + 40 < len(events):
        flush_usage(buffer)
"""

ROLLUP_LOOP_SCRIPT = """
import time
from usage.rollup import roll_up_usage
while True:
    if roll_up_usage(batch_size=5):
        print("rolled up", flush=True)
    time.sleep(0.002)  # SQLite hands its lock to no one in particular: let go
"""


def _make_events(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    start = time.time() - 240
    events = []
    for n in range(count):
        estimated = rng.random() < 0.2
        status = rng.choice([200] * 8 + [429, 502])
        error = "" if status < 400 else "upstream_error"
        if status == 200 and rng.random() < 0.05:
            error = "stream_interrupted"  # broke after the first byte
        prompt, completion = rng.randint(0, 900), rng.randint(0, 400)
        events.append(
            {
                "request_id": f"s{seed}-{n % 50}",  # repeats, as client ids may
                "endpoint": rng.choice(["chat", "completions", "embeddings"]),
                "api_key_prefix": rng.choice(["", "nx-aaaaaaaa", "nx-bbbbbbbb"]),
                "backend": rng.choice(["gpu-1", "gpu-2", "cloud"]),
                "requested_model": rng.choice(["gpt-4", "llama3:8b"]),
                "served_model": rng.choice(["llama3:8b", "llama3:70b", ""]),
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "estimated": estimated,
                "latency_ms": rng.uniform(5, 3000),
                "status": status,
                "streamed": rng.random() < 0.5,
                "error": error,
                "created_at": start + rng.uniform(0, 200),
            }
        )
    return events


def _spawn(script: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "manage.py", "shell", "--no-imports", "-c", script],
        cwd=REPO_ROOT,
        env=server_env(),
        text=True,
        **kwargs,
    )


@pytest.mark.django_db(transaction=True)
def test_totals_are_exact_across_processes_concurrent_and_killed_rollups() -> None:
    shares = [_make_events(300, seed) for seed in range(3)]
    every_event = [event for share in shares for event in share]

    # A rollup process that will be killed mid-work.
    doomed = _spawn(ROLLUP_LOOP_SCRIPT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # Three serving processes, each recording and flushing its own requests.
    servers = [_spawn(SERVING_SCRIPT, stdin=subprocess.PIPE) for _ in shares]
    for server, share in zip(servers, shares, strict=True):
        assert server.stdin is not None
        server.stdin.write(json.dumps(share))
        server.stdin.close()

    # Once the doomed rollup has rolled some up it is busy with the next
    # batches, as the servers keep flushing: kill it in the middle of one.
    assert doomed.stdout is not None
    ready, _, _ = select.select([doomed.stdout], [], [], 90)
    assert ready, "the rollup process never rolled anything up"
    assert doomed.stdout.readline() == "rolled up\n"

    # Two more rollups in this process, concurrent with everything else.
    stop = threading.Event()

    def roll_up_until_stopped() -> None:
        try:
            while not stop.is_set():
                roll_up_usage(batch_size=7)
                time.sleep(0.005)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        rollers = [pool.submit(roll_up_until_stopped) for _ in range(2)]
        try:
            time.sleep(0.05)
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.wait(timeout=10)
            for server in servers:
                assert server.wait(timeout=90) == 0
        finally:
            stop.set()
            if doomed.poll() is None:
                doomed.kill()
        for roller in rollers:
            roller.result()  # raises what a rollup thread raised

    roll_up_usage()

    assert doomed.returncode == -signal.SIGKILL
    assert UsageRecord.objects.count() == len(every_event)
    assert not UsageRecord.objects.pending().exists()
    assert _series_totals(TokenUsage) == _expected_from_records(every_event)
    assert _series_totals(UsageBucket, "minute") == _expected_from_records(
        every_event, per_minute=True
    )
    grand = TokenUsage.objects.aggregate(t=Sum("total_tokens"))["t"]
    assert grand == sum(e["total_tokens"] for e in every_event)


@pytest.mark.django_db
def test_cache_hits_are_counted_and_their_tokens_are_saved_not_spent() -> None:
    from usage.models import KeySpend

    UsageRecordFactory(total_tokens=15, cost_nanos=7)
    UsageRecordFactory(backend="", total_tokens=15, cost_nanos=2, cache_hit=True)
    roll_up_usage()
    hits = TokenUsage.objects.get(backend="")
    assert (hits.requests, hits.cache_hits, hits.cache_saved_tokens) == (1, 1, 15)
    assert TokenUsage.objects.get(backend="gpu-1").cache_hits == 0
    spend = KeySpend.objects.get()
    # Both requests and both costs; only the computed answer's tokens.
    assert (spend.requests, spend.total_tokens, spend.cost_nanos) == (2, 15, 9)
