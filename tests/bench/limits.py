"""What keys' limits and budgets cost per request: ``make bench BENCH_ARGS=--limits``.

One Daphne process serving Nexus with the benchmark's settings (production
mode: the limiter on Redis), one mock backend. Two keys: one without limits,
one with every limit and both budgets (set far above what the run uses, so
nothing is refused: the cost measured is the checking, not refusals), and a
price on the model, so that costs are computed too. Latency at concurrency 1
comes from raw per-request samples of a keep-alive client (not wrk's
corrected percentiles), the two keys in alternating rounds so that drift in
the machine's load falls on both alike; throughput from wrk at 16
connections, where wrk is installed. With ``--profile``, py-spy records the
serving process for 10 s at c=1 for each key (``limits-<key>.txt`` in the
output directory, and the requests served meanwhile in ``limits.json``), so
that the two can be compared per request.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from backends.models import Backend, BackendModel, HealthStatus
from tests.bench.clients import (
    Endpoint,
    finish_wrk,
    measure_concurrently,
    start_wrk,
    write_wrk_script,
)
from tests.bench.processes import start_daphne
from tests.bench.profiles import record_profile
from usage.models import ApiKey, ModelPrice

MODEL = "nexus-bench-limits"
BACKEND = "bench-limits"
KEYS = ("bench-limits-off", "bench-limits-on")
LIMITS: dict[str, Any] = {
    "rpm_limit": 100_000_000,
    "tpm_limit": 2_000_000_000,
    "max_concurrency": 10_000,
    "budget_period": "month",
    "budget_tokens": 10**15,
    "budget_usd": Decimal(1_000_000),
}
BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
).encode()
ROUNDS = 6
WRK_CONNECTIONS = 16
PROFILE_SECONDS = 10.0


@contextlib.contextmanager
def _rows(url: str) -> Iterator[dict[str, str]]:
    with transaction.atomic():
        _delete_rows()
        backend = Backend.objects.create(
            name=BACKEND, base_url=url, status=HealthStatus.HEALTHY
        )
        BackendModel.objects.create(backend=backend, name=MODEL)
        ModelPrice.objects.create(
            model=MODEL,
            input_per_million=Decimal("0.5"),
            output_per_million=Decimal("1.5"),
        )
        keys = {
            KEYS[0]: ApiKey.objects.create_key(KEYS[0])[1],
            KEYS[1]: ApiKey.objects.create_key(KEYS[1], **LIMITS)[1],
        }
    try:
        yield keys
    finally:
        _delete_rows()


def _delete_rows() -> None:
    Backend.objects.filter(name=BACKEND).delete()
    ModelPrice.objects.filter(model=MODEL).delete()
    ApiKey.objects.filter(name__in=KEYS).delete()


def run_limits_benchmark(
    env: dict[str, str],
    spawn_mock: Callable[..., Any],
    logs: Path,
    seconds: float,
    wrk: str,
    progress: Callable[[str], None],
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """Measure latency at c=1 and throughput with limits off and on."""
    mock = spawn_mock("--models", MODEL, "--name", BACKEND, env=env)
    results: dict[str, Any] = {"limits_backend": settings.NEXUS_LIMITS_BACKEND}
    try:
        with _rows(mock.base_url) as keys:
            server = start_daphne(env, logs)
            try:
                endpoints = {
                    name: Endpoint.keyed(
                        server.url, "/v1/chat/completions", BODY, keys[name]
                    )
                    for name in KEYS
                }
                # Warm up: the first requests load the configuration and the
                # limiter's scripts.
                for endpoint in endpoints.values():
                    measure_concurrently(endpoint, 1, 1.0, expect=b"choices")
                samples: dict[str, list[int]] = {name: [] for name in KEYS}
                errors = dict.fromkeys(KEYS, 0)
                # The serving process's CPU (user + system) during each key's
                # rounds: less moved by the machine's other work than latency.
                cpu = dict.fromkeys(KEYS, 0.0)
                for index in range(ROUNDS):
                    for name in KEYS if index % 2 == 0 else KEYS[::-1]:
                        progress(f"round {index + 1}/{ROUNDS}: {name}, c=1")
                        before = server.cpu_seconds()
                        run = measure_concurrently(
                            endpoints[name], 1, seconds / ROUNDS, expect=b"choices"
                        )
                        cpu[name] += server.cpu_seconds() - before
                        samples[name] += run.latencies_ns
                        errors[name] += run.errors
                for name in KEYS:
                    count = len(samples[name])
                    results[name] = {
                        "p50_ms": _pct(samples[name], 50),
                        "p90_ms": _pct(samples[name], 90),
                        "samples": count,
                        "errors": errors[name],
                        "cpu_us_per_request": cpu[name] / max(count, 1) * 1e6,
                    }
                if profile_dir is not None:
                    for name in KEYS:
                        progress(f"profile at c=1: {name}")
                        results[name]["profile"] = _profile(
                            server, endpoints[name], profile_dir / f"limits-{name}.txt"
                        )
                if shutil.which(wrk):
                    for name in KEYS:
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
    """py-spy on the serving process while one client sends requests back to
    back: where a request's CPU goes with this key (samples per request)."""
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


def format_limits_report(results: dict[str, Any]) -> str:
    off, on = results[KEYS[0]], results[KEYS[1]]
    added = on["p50_ms"] - off["p50_ms"]
    title = (
        f"Keys' limits and budgets, one Daphne process, limiter "
        f"{results['limits_backend'] or 'default'}; raw latency at c=1"
    )
    lines = [
        title,
        "",
        "| key | p50 | p90 | samples | errors | CPU per request | req/s (wrk c=16) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in ((KEYS[0], off), (KEYS[1], on)):
        rps = f"{row['rps']:.0f}" if "rps" in row else "-"
        lines.append(
            f"| {name} | {row['p50_ms']:.3f} ms | {row['p90_ms']:.3f} ms | "
            f"{row['samples']} | {row['errors']} | "
            f"{row['cpu_us_per_request']:.0f} µs | {rps} |"
        )
    verdict = "PASS" if added <= 0.15 else "MISS"
    added_cpu = on["cpu_us_per_request"] - off["cpu_us_per_request"]
    lines += [
        "",
        f"Added p50 at c=1: {added:.3f} ms (goal <= 0.15 ms: {verdict})",
        f"Added CPU per request at c=1 (the serving process): {added_cpu:.0f} µs",
    ]
    if "rps" in off and "rps" in on and off["rps"]:
        lines.append(f"Throughput ratio on/off: {on['rps'] / off['rps']:.3f}")
    return "\n".join(lines)
