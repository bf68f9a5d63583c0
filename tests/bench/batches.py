"""The batch benchmark: interactive latency beside a batch, and the batch's
share of the fleet's idle time.

``make bench BENCH_ARGS=--batches``. One mock backend with 8 slots and 200 ms
per request (its max_concurrency 8: a band of 8, the batch lane's limit 7).
An interactive client sends 2 requests a second (open loop) for a while
alone, then again while a Celery worker runs a 500-line chat batch through
the gateway. Goals (issue 34): interactive p50 beside the batch <= 1.2x and
p99 <= 1.5x alone; the batch's throughput >= 80 % of what the slots the
interactive traffic leaves idle can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from django.db import transaction

from backends.models import Backend, BackendModel, HealthStatus
from tests.bench.admission import _pct, paced_requests
from tests.bench.clients import BenchError
from tests.bench.processes import start_daphne
from usage.models import ApiKey

MODEL = "nexus-bench-batch"
SLOTS = 8
LATENCY_MS = 200
INTERACTIVE_RATE = 2.0  # requests a second
LINES = 500
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
KEYS = ("bench-batch-owner", "bench-batch-interactive")


@contextlib.contextmanager
def _rows(url: str) -> Iterator[tuple[str, str]]:
    with transaction.atomic():
        Backend.objects.filter(name="bench-batch").delete()
        ApiKey.objects.filter(name__in=KEYS).delete()
        backend = Backend.objects.create(
            name="bench-batch",
            base_url=url,
            status=HealthStatus.HEALTHY,
            max_concurrency=SLOTS,
        )
        BackendModel.objects.create(backend=backend, name=MODEL)
        owner = ApiKey.objects.create_key(KEYS[0])[1]
        interactive = ApiKey.objects.create_key(KEYS[1])[1]
    try:
        yield owner, interactive
    finally:
        Backend.objects.filter(name="bench-batch").delete()
        ApiKey.objects.filter(name__in=KEYS).delete()


def _start_worker(env: dict[str, str], logs: Path) -> subprocess.Popen[bytes]:
    log = (logs / "batch-worker.log").open("wb")
    command = [
        sys.executable, "-m", "celery", "-A", "nexus_site", "worker",
        "--queues", env["NEXUS_BATCH_QUEUE"], "--pool", "threads",
        "--concurrency", "2", "--without-mingle", "--without-gossip",
        "--loglevel", "INFO", "--hostname", f"bench-{uuid.uuid4().hex[:6]}@%h",
    ]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


async def _interactive(
    client: httpx.AsyncClient, key: str, until: Callable[[], bool]
) -> tuple[list[float], int]:
    return await paced_requests(client, key, BODY, INTERACTIVE_RATE, until)


async def _scenario(base_url: str, owner: str, key: str, seconds: float) -> dict:
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout, trust_env=False
    ) as client:
        end = time.monotonic() + seconds
        alone, alone_failed = await _interactive(
            client, key, lambda: time.monotonic() >= end
        )
        lines = "\n".join(
            json.dumps(
                {
                    "custom_id": f"line-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": BODY,
                }
            )
            for i in range(LINES)
        )
        auth = {"authorization": f"Bearer {owner}"}
        uploaded = await client.post(
            "/v1/files",
            headers=auth,
            data={"purpose": "batch"},
            files={"file": ("bench.jsonl", lines.encode())},
        )
        if uploaded.status_code != 200:
            raise BenchError(f"batch upload failed: {uploaded.text}")
        created = await client.post(
            "/v1/batches",
            headers=auth,
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        batch_id = created.json()["id"]
        state: dict[str, Any] = {}
        progress: list[tuple[float, int]] = []  # (time, lines done)

        async def watch() -> None:
            while True:
                reply = await client.get(f"/v1/batches/{batch_id}", headers=auth)
                state.update(reply.json())
                progress.append(
                    (time.monotonic(), state["request_counts"]["completed"])
                )
                if state["status"] in ("completed", "failed", "expired", "cancelled"):
                    return
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch())
        while state.get("status") != "in_progress" and not watcher.done():
            await asyncio.sleep(0.05)
        started = time.monotonic()
        beside, beside_failed = await _interactive(client, key, watcher.done)
        await watcher
    counts = state["request_counts"]
    return {
        "alone_p50_ms": _pct(alone, 50),
        "alone_p99_ms": _pct(alone, 99),
        "alone_samples": len(alone),
        "beside_p50_ms": _pct(beside, 50),
        "beside_p99_ms": _pct(beside, 99),
        "beside_samples": len(beside),
        "interactive_failed": alone_failed + beside_failed,
        "batch_status": state["status"],
        "batch_completed": counts["completed"],
        "batch_failed": counts["failed"],
        "batch_seconds": time.monotonic() - started,
        "steady_lines_per_second": _steady_rate(progress),
        "interactive_mean_s": sum(beside) / len(beside) if beside else 0.0,
    }


def _steady_rate(progress: list[tuple[float, int]]) -> float:
    """Lines a second between 10 % and 90 % of the batch done (the batch's
    start and its last lines draining are not what yielding costs)."""
    low = next((p for p in progress if p[1] >= LINES // 10), None)
    high = next((p for p in progress if p[1] >= LINES * 9 // 10), None)
    if low is None or high is None or high[0] <= low[0]:
        return 0.0
    return (high[1] - low[1]) / (high[0] - low[0])


def run_batch_benchmark(
    env: dict[str, str],
    spawn_mock: Callable[..., Any],
    logs: Path,
    seconds: float,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Interactive latency alone and beside a 500-line batch; the batch's rate."""
    mock = spawn_mock(
        "--models", MODEL, "--name", "batch-fleet", "--slots", str(SLOTS),
        "--latency-ms", str(LATENCY_MS), env=env,
    )  # fmt: skip
    storage = Path(tempfile.mkdtemp(prefix="nexus-bench-batches-"))
    env = env | {
        "NEXUS_BATCH_DIR": str(storage),
        "NEXUS_BATCH_QUEUE": f"bench-batches-{uuid.uuid4().hex[:8]}",
        "NEXUS_BATCH_CONCURRENCY": str(2 * SLOTS),
    }
    try:
        with _rows(mock.base_url) as (owner, key):
            server = start_daphne(env, logs)
            worker = _start_worker(env | {"NEXUS_BATCH_GATEWAY_URL": server.url}, logs)
            try:
                progress(
                    f"interactive {INTERACTIVE_RATE:g}/s alone for {seconds:g} s, "
                    f"then beside a {LINES}-line batch"
                )
                results = asyncio.run(_scenario(server.url, owner, key, seconds))
            finally:
                worker.terminate()
                worker.wait(timeout=30)
                server.stop()
    finally:
        mock.stop()
    return results


def format_batch_report(results: dict[str, Any]) -> str:
    r = results
    capacity = SLOTS / (LATENCY_MS / 1000)  # lines a second with every slot
    interactive_slots = INTERACTIVE_RATE * r["interactive_mean_s"]
    idle_rate = (SLOTS - interactive_slots) / (LATENCY_MS / 1000)
    batch_rate = r["batch_completed"] / r["batch_seconds"] if r["batch_seconds"] else 0
    steady = r["steady_lines_per_second"]
    share = steady / idle_rate if idle_rate else 0.0
    p50 = r["beside_p50_ms"] / r["alone_p50_ms"]
    p99 = r["beside_p99_ms"] / r["alone_p99_ms"]
    verdict = {True: "PASS", False: "MISS"}
    return "\n".join(
        [
            (
                f"1 mock x {SLOTS} slots, {LATENCY_MS} ms a request ({capacity:.0f} "
                f"req/s in all); interactive {INTERACTIVE_RATE:g} req/s; a {LINES}-line "
                "chat batch"
            ),
            "",
            "| interactive | p50 | p99 | samples |",
            "|---|---|---|---|",
            (
                f"| alone | {r['alone_p50_ms']:.0f} ms | {r['alone_p99_ms']:.0f} ms | "
                f"{r['alone_samples']} |"
            ),
            (
                f"| beside the batch | {r['beside_p50_ms']:.0f} ms | "
                f"{r['beside_p99_ms']:.0f} ms | {r['beside_samples']} |"
            ),
            "",
            (
                f"Batch: {r['batch_status']}, {r['batch_completed']} lines ok, "
                f"{r['batch_failed']} failed, in {r['batch_seconds']:.1f} s = "
                f"{batch_rate:.1f} lines/s overall, {steady:.1f} lines/s from 10 % "
                f"to 90 % done; the slots interactive traffic left idle "
                f"({SLOTS - interactive_slots:.2f}) serve {idle_rate:.1f}/s. "
                f"Interactive failures: {r['interactive_failed']}."
            ),
            (
                f"Goal: interactive p50 beside <= 1.2x alone: {p50:.2f}x "
                f"({verdict[p50 <= 1.2]})"
            ),
            (
                f"Goal: interactive p99 beside <= 1.5x alone: {p99:.2f}x "
                f"({verdict[p99 <= 1.5]})"
            ),
            (
                f"Goal: batch throughput (steady) >= 80 % of the idle capacity: "
                f"{share:.0%} "
                f"({verdict[share >= 0.8]})"
            ),
        ]
    )
