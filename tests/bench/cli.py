"""Benchmark the proxy: the mock backend directly versus through Nexus."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from django.conf import settings
from django.core.management import call_command

from tests.bench.clients import BenchError
from tests.bench.database import child_environment, ensure_database
from tests.bench.plan import (
    DEFAULT_DURATION,
    DEFAULT_WARMUP,
    BenchOptions,
    estimate_seconds,
)
from tests.bench.processes import (
    DEFAULT_TARGETS,
    LITELLM,
    TARGET_CHOICES,
    TargetSpec,
    parse_targets,
)
from tests.bench.report import format_report, write_json
from tests.bench.runner import run_benchmark

DESCRIPTION = (
    "Measure what the proxy costs: start a mock backend, then each target "
    "(a bare Daphne app for reference, Nexus under Daphne, uvicorn and granian "
    "in one process and in N processes on one port, LiteLLM with --litellm), "
    "load it with wrk and latency probes, and print requests/s, p50/p99 "
    "latency, streaming time-to-first-byte at a paced rate, CPU per request "
    "and memory, direct versus through each target, against the goals of "
    "issue 11. `make bench` runs it with production-style settings "
    "(PostgreSQL and Redis); `make bench-peers` adds LiteLLM."
)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (``make bench BENCH_ARGS=...``)."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench", description=DESCRIPTION
    )
    parser.add_argument(
        "--duration",
        type=int,
        default=DEFAULT_DURATION,
        help=f"Seconds per measurement (default {DEFAULT_DURATION}). The "
        "run prints its estimated length before it starts (about 4 minutes "
        "with the defaults).",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=DEFAULT_WARMUP,
        help=f"Seconds of load before each target is measured (default "
        f"{DEFAULT_WARMUP:g}).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Smoke mode: no warm-up, for checking that the benchmark runs.",
    )
    parser.add_argument(
        "--servers",
        default=",".join(DEFAULT_TARGETS),
        help="Comma-separated targets to measure, from "
        f"{', '.join(TARGET_CHOICES)} (NAME-xN: N processes on one port; "
        f"default: {','.join(DEFAULT_TARGETS)}).",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 2,
        help="N of the NAME-xN targets (default: the number of CPUs, "
        f"{os.cpu_count()} here).",
    )
    parser.add_argument(
        "--litellm",
        metavar="PATH",
        help="Also measure LiteLLM's proxy, one worker on the same mock, with "
        "this `litellm` executable (make bench-peers installs one).",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="Do not pin single-process targets to CPUs with taskset.",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="After measuring each Nexus target, record a py-spy profile "
        "(collapsed stacks) under 16 connections into the output directory, "
        "and report its top frames (with --limits: one per key, at c=1).",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(settings.BASE_DIR) / "bench-results",
        help="Directory for the JSON report (default: bench-results/).",
    )
    parser.add_argument(
        "--no-surfaces",
        dest="surfaces",
        action="store_false",
        help="Skip the protocol surface paths (an Anthropic client translated "
        "for the OpenAI mock, and passed through to an Anthropic-kind mock), "
        "measured on the first single-process Nexus target.",
    )
    parser.add_argument(
        "--all-surfaces",
        action="store_true",
        help="Also measure a Responses client (POST /v1/responses) and an Ollama "
        "client (POST /api/chat) translated for the OpenAI mock.",
    )
    parser.add_argument(
        "--admission",
        action="store_true",
        help="Instead: admission control's benchmark (two tenants on a fleet "
        "of 2 mocks x 4 slots, admission off and on, and the bypass cost).",
    )
    parser.add_argument(
        "--prefix",
        action="store_true",
        help="Instead: prefix-aware routing's benchmark (3 mock nodes with "
        "prompt caches, 12 tenants with long system prompts; smart and fleet "
        "with and without [routing.prefix], and a workload sharing nothing).",
    )
    parser.add_argument(
        "--prefix-requests",
        type=int,
        default=240,
        help="Requests per run in the prefix benchmark (default 240).",
    )
    parser.add_argument(
        "--prefix-guards",
        default="1,2,8",
        help="Also run smart + prefix with each of these max_imbalance values "
        "(comma-separated; empty for none).",
    )
    parser.add_argument(
        "--fleet",
        action="store_true",
        help="Instead: fleet scheduling's benchmark (3 mock Ollama nodes, 6 "
        "models, cold loads; round_robin, smart and fleet compared).",
    )
    parser.add_argument(
        "--fleet-variants",
        action="store_true",
        help="Instead: the fleet benchmark's variants (a node joining mid-run "
        "under fleet; mixed prompt sizes with the admission stock counted in "
        "requests, then in tokens).",
    )
    parser.add_argument(
        "--fleet-requests",
        type=int,
        default=360,
        help="Requests per strategy in the fleet benchmark (default 360: "
        "2 minutes of traffic, past the start from an empty fleet).",
    )
    parser.add_argument(
        "--fleet-strategies",
        default="round_robin,smart,fleet",
        help="Comma-separated strategies the fleet benchmark compares.",
    )
    parser.add_argument(
        "--limits",
        action="store_true",
        help="Instead: what keys' limits and budgets cost (a key without limits "
        "and one with all of them: raw p50 at c=1 and wrk throughput).",
    )
    parser.add_argument(
        "--cache",
        action="store_true",
        help="Instead: what the response cache gives (a hit against a proxied "
        "request and against an answer Nexus gives itself, at c=1; hits and "
        "proxied requests per second with wrk).",
    )
    parser.add_argument(
        "--relay",
        action="store_true",
        help="Instead: what the worker relay adds (a mock behind nexus-worker "
        "versus the same mock by URL, c=8, one process without Redis and two "
        "processes over Redis).",
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="Instead: what OpenTelemetry traces cost (the same chat through a "
        "Nexus with traces off and one exporting to an OTLP receiver: raw p50 "
        "and CPU per request at c=1, wrk throughput).",
    )
    parser.add_argument("--wrk", default="wrk", help="The wrk executable.")
    parser.add_argument(
        "--json",
        dest="as_json",
        action="store_true",
        help="Print the JSON report instead of the table.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark with Django already set up; return the exit status.

    Bad options exit through argparse (status 2) with a message naming them.
    """
    parser = build_parser()
    options = parser.parse_args(argv)
    if options.admission:
        return _admission(options)
    if options.limits:
        return _limits(options)
    if options.cache:
        return _cache(options)
    if options.fleet:
        if not 10 <= options.fleet_requests <= 10_000:
            parser.error("--fleet-requests must be within 10..10000.")
        return _fleet(options)
    if options.fleet_variants:
        return _fleet_variants(options)
    if options.prefix:
        if not 12 <= options.prefix_requests <= 10_000:
            parser.error("--prefix-requests must be within 12..10000.")
        return _prefix(options)
    if options.relay:
        return _relay(options)
    if options.tracing:
        return _tracing(options)
    if options.duration < 1:
        parser.error("--duration must be at least 1 second.")
    if not 2 <= options.workers <= 64:
        parser.error(f"--workers must be within 2..64, not {options.workers}.")
    names = [s.strip() for s in options.servers.split(",") if s.strip()]
    try:
        targets = parse_targets(names, options.workers)
    except ValueError as error:
        parser.error(
            f"--servers takes some of {', '.join(TARGET_CHOICES)}, not {error}."
        )
    if not targets and not options.litellm:
        parser.error(f"--servers takes some of {', '.join(TARGET_CHOICES)}.")
    if options.litellm:
        litellm = shutil.which(options.litellm)
        if litellm is None:
            parser.error(
                f"--litellm: {options.litellm!r} is not an executable (make "
                "bench-peers installs LiteLLM into .bench-peers/litellm/)."
            )
        targets += (TargetSpec(LITELLM, LITELLM, role="peer"),)
    bench = BenchOptions(
        duration=options.duration,
        warmup=0.0 if options.quick else max(0.0, options.warmup),
        targets=targets,
        pin=options.pin,
        profile_dir=options.output if options.profile else None,
        wrk=options.wrk,
        litellm=str(Path(litellm).absolute()) if options.litellm else None,
        surfaces=options.surfaces,
        all_surfaces=options.all_surfaces,
    )
    estimate = estimate_seconds(bench)
    _progress(
        f"Measuring the mock directly and {', '.join(t.label for t in targets)}: "
        f"about {estimate / 60:.1f} minutes ({round(estimate)} s)"
    )
    ensure_database()
    call_command("migrate", interactive=False, verbosity=0)
    # SIGTERM unwinds like Ctrl-C, so the mock and servers are stopped too.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        report = run_benchmark(bench, child_environment(), _progress)
    except BenchError as error:
        sys.stderr.write(f"The benchmark failed: {error}\n")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    path = write_json(report, options.output)
    if options.as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(format_report(report) + "\n")
        sys.stdout.write(f"\nJSON report: {path}\n")
    return 0


def _with_mocks(
    options: argparse.Namespace,
    name: str,
    run: Callable[[dict[str, str], Callable[..., Any], Path], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
) -> int:
    """Run a benchmark that starts mock backends and Nexus servers: the
    database migrated, `run` given the children's environment, the mock
    spawner and a log directory; its results in `name`.json and a report."""
    from nexus_mock import spawn_mock_backend

    ensure_database()
    call_command("migrate", interactive=False, verbosity=0)
    logs = options.output / f"{name}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        results = run(child_environment(), spawn_mock_backend, logs)
    except BenchError as error:
        sys.stderr.write(f"The benchmark failed: {error}\n")
        return 1
    (options.output / f"{name}.json").write_text(json.dumps(results, indent=2))
    sys.stdout.write(report(results) + "\n")
    return 0


def _admission(options: argparse.Namespace) -> int:
    from tests.bench.admission import (
        format_admission_report,
        run_admission_benchmark,
    )

    seconds = max(10.0, 3.0 * options.duration)
    return _with_mocks(
        options,
        "admission",
        lambda env, spawn, logs: run_admission_benchmark(
            env, spawn, logs, seconds, _progress
        ),
        format_admission_report,
    )


def _fleet(options: argparse.Namespace) -> int:
    from tests.bench.fleet import format_fleet_report, run_fleet_benchmark

    strategies = tuple(
        s.strip() for s in options.fleet_strategies.split(",") if s.strip()
    )
    return _with_mocks(
        options,
        "fleet",
        lambda env, spawn, logs: run_fleet_benchmark(
            env, spawn, logs, options.fleet_requests, _progress, strategies
        ),
        format_fleet_report,
    )


def _prefix(options: argparse.Namespace) -> int:
    from tests.bench.prefix import format_prefix_report, run_prefix_benchmark

    return _with_mocks(
        options,
        "prefix",
        lambda env, spawn, logs: run_prefix_benchmark(
            env,
            spawn,
            logs,
            options.prefix_requests,
            _progress,
            tuple(int(g) for g in options.prefix_guards.split(",") if g.strip()),
        ),
        format_prefix_report,
    )


def _fleet_variants(options: argparse.Namespace) -> int:
    from tests.bench.fleet_variants import (
        format_fleet_variants_report,
        run_fleet_variants,
    )

    return _with_mocks(
        options,
        "fleet-variants",
        lambda env, spawn, logs: run_fleet_variants(
            env, spawn, logs, options.fleet_requests, _progress
        ),
        format_fleet_variants_report,
    )


def _limits(options: argparse.Namespace) -> int:
    from tests.bench.limits import format_limits_report, run_limits_benchmark

    seconds = max(6.0, 3.0 * options.duration)
    profile = options.output if options.profile else None
    return _with_mocks(
        options,
        "limits",
        lambda env, spawn, logs: run_limits_benchmark(
            env, spawn, logs, seconds, options.wrk, _progress, profile
        ),
        format_limits_report,
    )


def _cache(options: argparse.Namespace) -> int:
    from tests.bench.cache import format_cache_report, run_cache_benchmark

    seconds = max(6.0, 3.0 * options.duration)
    return _with_mocks(
        options,
        "cache",
        lambda env, spawn, logs: run_cache_benchmark(
            env,
            spawn,
            logs,
            seconds,
            options.wrk,
            _progress,
            options.output if options.profile else None,
        ),
        format_cache_report,
    )


def _tracing(options: argparse.Namespace) -> int:
    from tests.bench.tracing import format_tracing_report, run_tracing_benchmark

    seconds = max(6.0, 3.0 * options.duration)
    return _with_mocks(
        options,
        "tracing",
        lambda env, spawn, logs: run_tracing_benchmark(
            env, spawn, logs, seconds, options.wrk, _progress
        ),
        format_tracing_report,
    )


def _relay(options: argparse.Namespace) -> int:
    from tests.bench.relay import format_relay_report, run_relay_benchmark

    ensure_database()
    call_command("migrate", interactive=False, verbosity=0)
    try:
        results = run_relay_benchmark(
            options.output / "relay-logs", max(2.0, options.duration), _progress
        )
    except (RuntimeError, OSError) as error:
        sys.stderr.write(f"The benchmark failed: {error}\n")
        return 1
    (options.output / "relay.json").write_text(json.dumps(results, indent=2))
    sys.stdout.write(format_relay_report(results) + "\n")
    return 0


def _progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
