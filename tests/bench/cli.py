"""Benchmark the proxy: the mock backend directly versus through Nexus."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from django.conf import settings
from django.core.management import call_command

from tests.bench.clients import BenchError
from tests.bench.database import child_environment, ensure_database
from tests.bench.processes import SERVERS
from tests.bench.report import format_report, write_json
from tests.bench.runner import BenchOptions, run_benchmark

DESCRIPTION = (
    "Measure what the proxy costs: start a mock backend and one Nexus serving "
    "process (Daphne, then uvicorn), load both with wrk and latency probes, and "
    "print requests/s, p50/p99 latency, streaming time-to-first-byte and peak "
    "RSS, direct versus through Nexus, against the goals of issue 6. `make "
    "bench` runs it with production-style settings (PostgreSQL and Redis)."
)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (``make bench BENCH_ARGS=...``)."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench", description=DESCRIPTION
    )
    parser.add_argument(
        "--duration",
        type=int,
        default=10,
        help="Seconds per measurement (default 10). A run makes 8 measurements "
        "of the mock directly and 8 through each server: about 5 minutes.",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        help="Seconds of load before each target is measured (default 3).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Smoke mode: no warm-up, for checking that the benchmark runs.",
    )
    parser.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help="Comma-separated serving processes to measure (default: "
        f"{','.join(SERVERS)}).",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="Do not pin processes to CPUs with taskset.",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="After measuring, record a py-spy flame graph of each serving "
        "process under 16 connections (into the output directory).",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(settings.BASE_DIR) / "bench-results",
        help="Directory for the JSON report (default: bench-results/).",
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
    servers = tuple(s.strip() for s in options.servers.split(",") if s.strip())
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown or not servers:
        parser.error(
            f"--servers takes some of {', '.join(SERVERS)}, not {options.servers!r}."
        )
    if options.duration < 1:
        parser.error("--duration must be at least 1 second.")
    bench = BenchOptions(
        duration=options.duration,
        warmup=0.0 if options.quick else max(0.0, options.warmup),
        servers=servers,
        pin=options.pin,
        profile_dir=options.output if options.profile else None,
        wrk=options.wrk,
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


def _progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
