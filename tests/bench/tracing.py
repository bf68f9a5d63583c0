"""What OpenTelemetry traces cost: ``make bench BENCH_ARGS=--tracing``.

One mock backend and two Daphne processes serving Nexus with the benchmark's
settings: one with traces off (no ``OTEL_*``), one exporting every request's
spans over OTLP/HTTP to a receiver in this process (tests/otlp_receiver.py,
counting what arrives without decoding it: it shares the load client's
CPU, and decoding there slowed the measured requests). The same
chat at concurrency 1 from raw per-request samples of a keep-alive client,
in alternating rounds so that drift in the machine's load falls on both
alike, with each server's CPU time per request (its export thread
included); then wrk at 16 connections against each.

The goal (issue 36): at most 50 µs added per request with export on; off,
nothing (the proxy makes no tracing call at all, which the tests check).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
from tests.bench.report import latency_table
from tests.otlp_receiver import otlp_receiver
from usage.models import ApiKey

MODEL = "nexus-bench-tracing"
BACKEND = "bench-tracing"
KEY = "bench-tracing"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Trace me."}]}
CHAT_PATH = "/v1/chat/completions"
CHAT_BODY = json.dumps(CHAT).encode()
ROUNDS = 6
WRK_CONNECTIONS = 16
GOAL_US = 50.0
SERVERS = ("off", "on")


@contextlib.contextmanager
def _rows(url: str) -> Iterator[str]:
    with transaction.atomic():
        _delete_rows()
        backend = Backend.objects.create(
            name=BACKEND, base_url=url, status=HealthStatus.HEALTHY
        )
        BackendModel.objects.create(backend=backend, name=MODEL)
        key = ApiKey.objects.create_key(KEY)[1]
    try:
        yield key
    finally:
        _delete_rows()


def _delete_rows() -> None:
    Backend.objects.filter(name=BACKEND).delete()
    ApiKey.objects.filter(name=KEY).delete()


def run_tracing_benchmark(
    env: dict[str, str],
    spawn_mock: Callable[..., Any],
    logs: Path,
    seconds: float,
    wrk: str,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Measure the same chat through a Nexus with traces off and one with them on."""
    mock = spawn_mock("--models", MODEL, "--name", BACKEND, env=env)
    results: dict[str, Any] = {}
    servers: dict[str, Any] = {}
    try:
        with _rows(mock.base_url) as key, otlp_receiver(decode=False) as receiver:
            off = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
            servers["off"] = start_daphne(off, logs)
            servers["on"] = start_daphne(
                off | {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}, logs
            )
            endpoints = {
                name: Endpoint.keyed(servers[name].url, CHAT_PATH, CHAT_BODY, key)
                for name in SERVERS
            }
            for endpoint in endpoints.values():  # warm up
                measure_concurrently(endpoint, 1, 1.0, expect=b"choices")
            samples: dict[str, list[int]] = {name: [] for name in SERVERS}
            cpu = dict.fromkeys(SERVERS, 0.0)
            errors = dict.fromkeys(SERVERS, 0)
            for index in range(ROUNDS):
                for name in SERVERS if index % 2 == 0 else SERVERS[::-1]:
                    progress(f"round {index + 1}/{ROUNDS}: traces {name}, c=1")
                    server = servers[name]
                    before = server.cpu_seconds()
                    run = measure_concurrently(
                        endpoints[name], 1, seconds / ROUNDS, expect=b"choices"
                    )
                    cpu[name] += server.cpu_seconds() - before
                    samples[name] += run.latencies_ns
                    errors[name] += run.errors
            for name in SERVERS:
                count = len(samples[name])
                results[name] = {
                    "p50_ms": statistics.median(samples[name]) / 1e6,
                    "p90_ms": _percentile(samples[name], 90) / 1e6,
                    "samples": count,
                    "errors": errors[name],
                    "cpu_us_per_request": cpu[name] / max(count, 1) * 1e6,
                }
            if shutil.which(wrk):
                for name in SERVERS:
                    progress(f"wrk c={WRK_CONNECTIONS}: traces {name}")
                    script = write_wrk_script(logs, endpoints[name], f"tracing-{name}")
                    result = finish_wrk(
                        start_wrk(
                            wrk, endpoints[name], script, WRK_CONNECTIONS, seconds
                        )
                    )
                    results[name]["rps"] = result.requests_per_s
                    results[name]["wrk_errors"] = result.errors
            servers["on"].stop()  # its last batch goes out as it stops
            del servers["on"]
            results["exports_received"] = receiver.requests
            results["bytes_received"] = receiver.bytes
    finally:
        for server in servers.values():
            server.stop()
        mock.stop()
    return results


def _percentile(samples: list[int], pct: int) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def format_tracing_report(results: dict[str, Any]) -> str:
    lines = [
        "OpenTelemetry traces, one Daphne process each; raw latency at c=1",
        "",
        *latency_table("traces", {name: results[name] for name in SERVERS}),
    ]
    on, off = results["on"], results["off"]
    cpu = on["cpu_us_per_request"] - off["cpu_us_per_request"]
    p50 = (on["p50_ms"] - off["p50_ms"]) * 1000
    lines += [
        "",
        _verdict("Added CPU per request (export included)", cpu),
        _verdict("Added p50 at c=1", p50),
        (
            f"The receiver got {results['exports_received']} export requests, "
            f"{results['bytes_received'] / 1e6:.1f} MB"
        ),
    ]
    if "rps" in on and "rps" in off and off["rps"]:
        lines.append(
            f"Throughput with traces on: {on['rps'] / off['rps'] * 100:.0f} % of off"
        )
    return "\n".join(lines)


def _verdict(what: str, added_us: float) -> str:
    verdict = "PASS" if added_us <= GOAL_US else "MISS"
    return f"{what}: {added_us:.0f} µs (goal <= {GOAL_US:.0f} µs: {verdict})"
