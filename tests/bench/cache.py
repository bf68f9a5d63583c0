"""What the response cache gives: ``make bench BENCH_ARGS=--cache``.

One Daphne process serving Nexus with the benchmark's settings (production
mode: the cache in Redis), one mock backend, ``[cache]`` on. Four requests,
each measured at concurrency 1 from raw per-request samples of a keep-alive
client, in alternating rounds so that drift in the machine's load falls on
all alike:

* proxied: the chat with ``Cache-Control: no-store`` (bypassed: the mock
  answers it, the way every request went before the cache);
* hit: the same chat without it (answered from Redis after the first);
* stream hit: the same chat streamed (replayed as OpenAI SSE with usage);
* own answer: Anthropic's count_tokens, which Nexus answers itself after the
  same key check, parse and routing check as a chat: what any request the
  gateway answers without a backend costs, the reference a hit adds to.

A hit's added latency is its p50 minus the own answer's. Throughput: wrk at
16 connections, hits and proxied requests per second (the goal: hits at
least 3x the proxied rate, per process).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import RoutingPolicy
from tests.bench.clients import (
    Endpoint,
    finish_wrk,
    measure_concurrently,
    start_wrk,
    write_wrk_script,
)
from tests.bench.processes import start_daphne
from tests.bench.profiles import record_profile
from tests.bench.report import latency_table
from usage.models import ApiKey

MODEL = "nexus-bench-cache"
BACKEND = "bench-cache"
KEY = "bench-cache"
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "What is a response cache? " * 8}],
    "temperature": 0,
}
ROUNDS = 6
WRK_CONNECTIONS = 16
PROFILE_SECONDS = 10.0
# What each measured request is: (path, body, extra headers, expected bytes).
REQUESTS: dict[str, tuple[str, dict[str, Any], tuple[tuple[str, str], ...], bytes]] = {
    "proxied": (
        "/v1/chat/completions",
        CHAT,
        (("Cache-Control", "no-store"),),
        b"choices",
    ),
    "hit": ("/v1/chat/completions", CHAT, (), b"choices"),
    "stream_hit": (
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        (),
        b"data:",
    ),
    "own_answer": (
        "/v1/messages/count_tokens",
        {"model": MODEL, "messages": CHAT["messages"]},
        (),
        b"input_tokens",
    ),
}


@contextlib.contextmanager
def _rows(url: str) -> Iterator[str]:
    with transaction.atomic():
        _delete_rows()
        backend = Backend.objects.create(
            name=BACKEND, base_url=url, status=HealthStatus.HEALTHY
        )
        BackendModel.objects.create(backend=backend, name=MODEL)
        key = ApiKey.objects.create_key(KEY)[1]
        policy = RoutingPolicy.load()
        was_enabled = policy.cache_enabled
        policy.cache_enabled = True
        policy.save()
    try:
        yield key
    finally:
        _delete_rows()
        policy = RoutingPolicy.load()
        policy.cache_enabled = was_enabled
        policy.save()


def _delete_rows() -> None:
    Backend.objects.filter(name=BACKEND).delete()
    ApiKey.objects.filter(name=KEY).delete()


def _endpoint(url: str, key: str, name: str) -> Endpoint:
    path, body, headers, _ = REQUESTS[name]
    return Endpoint.keyed(url, path, json.dumps(body).encode(), key, headers)


def run_cache_benchmark(
    env: dict[str, str],
    spawn_mock: Callable[..., Any],
    logs: Path,
    seconds: float,
    wrk: str,
    progress: Callable[[str], None],
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """Measure hits, proxied requests and the gateway's own answers (with
    ``profile_dir``: py-spy on the serving process for 10 s of hits at c=1)."""
    mock = spawn_mock("--models", MODEL, "--name", BACKEND, env=env)
    results: dict[str, Any] = {"store": "redis" if settings.REDIS_URL else "memory"}
    try:
        with _rows(mock.base_url) as key:
            server = start_daphne(env, logs)
            try:
                endpoints = {
                    name: _endpoint(server.url, key, name) for name in REQUESTS
                }
                # Warm up: the configuration, the first miss stored, Redis's script.
                for name, endpoint in endpoints.items():
                    measure_concurrently(endpoint, 1, 1.0, expect=REQUESTS[name][3])
                samples: dict[str, list[int]] = {name: [] for name in REQUESTS}
                errors = dict.fromkeys(REQUESTS, 0)
                cpu = dict.fromkeys(REQUESTS, 0.0)
                names = list(REQUESTS)
                for index in range(ROUNDS):
                    for name in names if index % 2 == 0 else names[::-1]:
                        progress(f"round {index + 1}/{ROUNDS}: {name}, c=1")
                        before = server.cpu_seconds()
                        run = measure_concurrently(
                            endpoints[name],
                            1,
                            seconds / ROUNDS,
                            expect=REQUESTS[name][3],
                        )
                        cpu[name] += server.cpu_seconds() - before
                        samples[name] += run.latencies_ns
                        errors[name] += run.errors
                for name in REQUESTS:
                    count = len(samples[name])
                    results[name] = {
                        "p50_ms": _pct(samples[name], 50),
                        "p90_ms": _pct(samples[name], 90),
                        "samples": count,
                        "errors": errors[name],
                        "cpu_us_per_request": cpu[name] / max(count, 1) * 1e6,
                    }
                if profile_dir is not None:
                    progress("profile at c=1: hit")
                    results["hit"]["profile"] = _profile(
                        server, endpoints["hit"], profile_dir / "cache-hit.txt"
                    )
                if shutil.which(wrk):
                    for name in ("proxied", "hit"):
                        progress(f"wrk c={WRK_CONNECTIONS}: {name}")
                        script = write_wrk_script(logs, endpoints[name], name)
                        result = finish_wrk(
                            start_wrk(
                                wrk, endpoints[name], script, WRK_CONNECTIONS, seconds
                            )
                        )
                        results[name]["rps"] = result.requests_per_s
                        results[name]["wrk_errors"] = result.errors
            finally:
                server.stop()
    finally:
        mock.stop()
    return results


def _profile(server: Any, endpoint: Endpoint, output: Path) -> dict[str, Any]:
    runs = []
    load = threading.Thread(
        target=lambda: runs.append(
            measure_concurrently(endpoint, 1, PROFILE_SECONDS, expect=b"choices")
        )
    )
    load.start()
    try:
        summary = record_profile(server.pids(), int(PROFILE_SECONDS), output)
    finally:
        load.join()
    summary["requests"] = len(runs[0].latencies_ns) if runs else 0
    return summary


def _pct(samples_ns: list[int], pct: int) -> float:
    if not samples_ns:
        return float("nan")
    if pct == 50:
        return statistics.median(samples_ns) / 1e6
    ordered = sorted(samples_ns)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))] / 1e6


def format_cache_report(results: dict[str, Any]) -> str:
    lines = [
        (
            f"Response cache, one Daphne process, entries in {results['store']}; "
            "raw latency at c=1"
        ),
        "",
        *latency_table("request", {name: results[name] for name in REQUESTS}),
    ]
    added = results["hit"]["p50_ms"] - results["own_answer"]["p50_ms"]
    verdict = "PASS" if added <= 0.5 else "MISS"
    lines += [
        "",
        (
            f"A hit's added p50 at c=1 (hit - own answer): {added:.3f} ms "
            f"(goal <= 0.5 ms: {verdict})"
        ),
        (
            f"A hit's p50 against a proxied request's: "
            f"{results['hit']['p50_ms']:.3f} ms vs {results['proxied']['p50_ms']:.3f} ms"
        ),
    ]
    hit, proxied = results["hit"], results["proxied"]
    if "rps" in hit and "rps" in proxied and proxied["rps"]:
        ratio = hit["rps"] / proxied["rps"]
        lines.append(
            f"Hits per second against proxied: {ratio:.2f}x "
            f"(goal >= 3x: {'PASS' if ratio >= 3 else 'MISS'})"
        )
    return "\n".join(lines)
