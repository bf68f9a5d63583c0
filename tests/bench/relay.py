"""The worker relay's cost: the same mock served through a relay worker or by URL.

``make bench BENCH_ARGS=--relay``. Two identical mock backends: one registered
as an ordinary backend (``direct``: Nexus -> mock over HTTP), one behind a real
``nexus-worker`` (``relay``: Nexus -> WebSocket -> worker -> mock). Each is
loaded with the same requests at concurrency 8, in two set-ups:

- ``embedded``: one serving process without Redis (the in-memory channel
  layer): the worker's socket is in the process that takes the request, so a
  request goes straight to its consumer;
- ``production``: two serving processes with the Redis channel layer, the
  worker connected to the first and the client to the second, so every
  request and every chunk crosses Redis twice (request to the consumer,
  chunks back to the requesting process).

Reported: non-stream requests/s and p50 latency; the latency the relay adds
per request (p50 relay - p50 direct); and per streamed chunk: streams of
``CHUNKS`` chunks (the mock sends them without delay, so a stream's duration
is its per-chunk cost), (mean stream time relay - direct - the per-request
addition) / CHUNKS. Goals (issue 18, embedded): <= 2 ms per request and
<= 1 ms per chunk. A Python client shares the 2 cores with the servers, so
absolute numbers are low; compare relay with direct of the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from django.db import transaction

from backends.models import Backend, Worker
from nexus_mock.spawn import MockBackendProcess, spawn_mock_backend
from routing.versioning import read_config_version
from tests.bench.database import MODEL, child_environment, install_bench_rows

RELAY_WORKER = "nexus-bench-relay"
RELAY_MODEL = "nexus-bench-relay-model"
CONCURRENCY = 8
CHUNKS = 32
GOAL_REQUEST_MS = 2.0
GOAL_CHUNK_MS = 1.0
REPO_ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(condition: Callable[[], object], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _start_server(
    env: dict[str, str], log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nexus_site.servers.daphne_main",
            "-b",
            "127.0.0.1",
            "-p",
            str(port),
            "nexus_site.asgi:application",
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health/live", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    _wait_for(up, f"the server on port {port}")
    return process, url


def _config_version(url: str) -> int:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("nexus_config_version "):
            return int(float(line.split()[1]))
    return -1


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for process in reversed(started):
            process.terminate()
        for process in started:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


async def _load(
    url: str,
    key: str,
    body: dict[str, Any],
    duration: float,
    concurrency: int = CONCURRENCY,
) -> list[float]:
    """Each request's seconds, `concurrency` at a time for `duration` seconds."""
    times: list[float] = []
    headers = {"Authorization": f"Bearer {key}"}
    stop = time.perf_counter() + duration
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def loop() -> None:
            while time.perf_counter() < stop:
                started = time.perf_counter()
                async with session.post(
                    f"{url}/v1/chat/completions", json=body, headers=headers
                ) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}")
                times.append(time.perf_counter() - started)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return times


def _measure(url: str, key: str, model: str, duration: float) -> dict[str, float]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    asyncio.run(_load(url, key, chat, 1.0))  # warm-up
    plain = asyncio.run(_load(url, key, chat, duration))
    streams = asyncio.run(_load(url, key, {**chat, "stream": True}, duration))
    alone = asyncio.run(_load(url, key, chat, duration / 2, concurrency=1))
    return {
        "c1_p50_ms": statistics.median(alone) * 1000,
        "requests_per_s": len(plain) / duration,
        "p50_ms": statistics.median(plain) * 1000,
        "stream_mean_ms": statistics.fmean(streams) * 1000,
        "streams_per_s": len(streams) / duration,
    }


def _compare(direct: dict[str, float], relay: dict[str, float]) -> dict[str, float]:
    per_request = relay["p50_ms"] - direct["p50_ms"]
    per_chunk = (
        relay["stream_mean_ms"] - direct["stream_mean_ms"] - per_request
    ) / CHUNKS
    return {
        "added_ms_per_request_c1": relay["c1_p50_ms"] - direct["c1_p50_ms"],
        "throughput_ratio": relay["requests_per_s"] / direct["requests_per_s"],
        "added_ms_per_request": per_request,
        "added_ms_per_chunk": per_chunk,
    }


def run_relay_benchmark(
    output: Path, duration: float, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Measure direct versus relay in both set-ups; return the results."""
    output.mkdir(parents=True, exist_ok=True)
    direct_mock = spawn_mock_backend(
        "--models", MODEL, "--chunks", str(CHUNKS), output=output / "mock-direct.log"
    )
    relay_mock = spawn_mock_backend(
        "--models",
        RELAY_MODEL,
        "--chunks",
        str(CHUNKS),
        output=output / "mock-relay.log",
    )
    results: dict[str, Any] = {"concurrency": CONCURRENCY, "chunks": CHUNKS}
    try:
        with install_bench_rows(direct_mock.base_url) as key:
            for mode in ("embedded", "production"):
                progress(f"relay benchmark: {mode}")
                results[mode] = _run_mode(mode, key, relay_mock, output, duration)
    finally:
        direct_mock.stop()
        relay_mock.stop()
        _remove_worker()
    return results


def _remove_worker() -> None:
    with transaction.atomic():
        Backend.objects.filter(name=RELAY_WORKER).delete()
        Worker.objects.filter(name=RELAY_WORKER).delete()


def _run_mode(
    mode: str,
    key: str,
    relay_mock: MockBackendProcess,
    output: Path,
    duration: float,
) -> dict[str, Any]:
    _remove_worker()
    _, secret = Worker.objects.create_worker(RELAY_WORKER)
    env = child_environment() | {"NEXUS_ACCESS_LOG": "false"}
    if mode == "embedded":
        env.pop("REDIS_URL", None)
        env["NEXUS_USAGE_TRANSPORT"] = "database"
        env["NEXUS_LIMITS_BACKEND"] = "local"
    elif not env.get("REDIS_URL"):
        return {"skipped": "no REDIS_URL"}
    with _processes() as started:
        first, first_url = _start_server(env, output / f"{mode}-server-1.log")
        started.append(first)
        client_url = first_url
        if mode == "production":
            second, client_url = _start_server(env, output / f"{mode}-server-2.log")
            started.append(second)
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nexus_worker",
                "--server",
                first_url,
                "--backend",
                relay_mock.base_url,
                "--backend-kind",
                "openai",
                "--max-concurrency",
                "64",
                "--log-level",
                "WARNING",
            ],
            cwd=REPO_ROOT,
            env=dict(os.environ, NEXUS_WORKER_SECRET=secret),
            stdout=(output / f"{mode}-worker.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        started.append(worker)
        _wait_for(
            lambda: (
                Worker.objects.filter(name=RELAY_WORKER)
                .exclude(channel_name="")
                .exists()
            ),
            "the worker to register",
        )
        version = read_config_version()
        _wait_for(
            lambda: _config_version(client_url) >= version, "the config to be live"
        )
        direct = _measure(client_url, key, MODEL, duration)
        relay = _measure(client_url, key, RELAY_MODEL, duration)
    return {"direct": direct, "relay": relay, **_compare(direct, relay)}


def format_relay_report(results: dict[str, Any]) -> str:
    lines = [
        (
            f"Worker relay vs direct (c={results['concurrency']}, "
            f"{results['chunks']}-chunk streams)"
        ),
    ]
    for mode in ("embedded", "production"):
        found = results.get(mode)
        if not found or "skipped" in found:
            lines.append(f"  {mode}: skipped")
            continue
        direct, relay = found["direct"], found["relay"]
        lines += [
            f"  {mode}:",
            (
                f"    non-stream: direct {direct['requests_per_s']:.0f} req/s "
                f"p50 {direct['p50_ms']:.2f} ms; relay {relay['requests_per_s']:.0f} "
                f"req/s p50 {relay['p50_ms']:.2f} ms (x{found['throughput_ratio']:.2f})"
            ),
            (
                f"    streams: direct {direct['stream_mean_ms']:.1f} ms, relay "
                f"{relay['stream_mean_ms']:.1f} ms mean per stream"
            ),
            (
                f"    added: {found['added_ms_per_request']:.2f} ms per request, "
                f"{found['added_ms_per_chunk']:.3f} ms per chunk; at c=1 "
                f"{found['added_ms_per_request_c1']:.2f} ms per request "
                f"(p50 direct {direct['c1_p50_ms']:.2f}, relay "
                f"{relay['c1_p50_ms']:.2f})"
            ),
        ]
        if mode == "embedded":
            ok = (
                found["added_ms_per_request"] <= GOAL_REQUEST_MS
                and found["added_ms_per_chunk"] <= GOAL_CHUNK_MS
            )
            lines.append(
                f"    goal (<= {GOAL_REQUEST_MS:g} ms/request, <= "
                f"{GOAL_CHUNK_MS:g} ms/chunk): {'met' if ok else 'NOT met'}"
            )
    return "\n".join(lines)
