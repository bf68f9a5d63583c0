"""The benchmark report: comparisons, goals, the printed table and the JSON file."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.bench.runner import BenchOptions

SCHEMA_VERSION = 1
# A load average above this share of the CPUs before the run means that other
# processes compete for them.
BUSY_LOAD_SHARE = 0.5
METHOD = {
    "throughput": "wrk 4.1 (C, closed loop, keep-alive); at c=16/64 plus the probe",
    "latency": "raw per-request samples from a keep-alive probe client (Python "
    "asyncio on uvloop, plain sockets), never wrk's (coordinated-omission "
    "corrected) percentiles: at c=1 one sequential probe connection alone; at "
    "c=16/64 the probe holds c/4 of the c connections while wrk holds the rest",
    "streaming": "wrk for streams/s; a Python asyncio client with c connections "
    "for time to the first SSE data line (TTFB) and to the end of the stream",
    "memory": "VmHWM (peak resident set) of the serving process, from /proc",
}


@dataclass(frozen=True, slots=True)
class Goal:
    """One target from issue 6, checked for each serving process."""

    name: str
    unit: str
    limit: float
    at_most: bool  # True: the value must be <= limit; False: >= limit

    @property
    def target(self) -> str:
        limit = f"{self.limit:,.0f}" if self.limit >= 100 else f"{self.limit:g}"
        return f"{'<=' if self.at_most else '>='} {limit} {self.unit}"

    def is_met(self, value: float) -> bool:
        return value <= self.limit if self.at_most else value >= self.limit


GOALS = {
    "added_p50_c1": Goal("added p50 latency, chat c=1", "ms", 1.0, at_most=True),
    "rps_c16": Goal("throughput, chat c=16", "req/s", 1500.0, at_most=False),
    "ttfb_overhead": Goal(
        "streaming TTFB overhead (p50), c=8", "ms", 2.0, at_most=True
    ),
    "peak_rss": Goal("peak RSS of the serving process", "MB", 150.0, at_most=True),
}


# The streaming goal is judged at this concurrency (issue 6's benchmark).
GOAL_STREAM_CONCURRENCY = "8"


def summarize_ns(samples_ns: Sequence[int]) -> dict[str, float | int | None]:
    """Percentiles (nearest rank) of raw samples, in milliseconds."""
    if not samples_ns:
        return {"samples": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(samples_ns)

    def rank(p: float) -> float:
        index = max(0, math.ceil(p / 100 * len(ordered)) - 1)
        return round(ordered[index] / 1e6, 3)

    return {
        "samples": len(ordered),
        "mean": round(sum(ordered) / len(ordered) / 1e6, 3),
        "p50": rank(50),
        "p90": rank(90),
        "p99": rank(99),
        "max": round(ordered[-1] / 1e6, 3),
    }


def build_report(
    results: dict[str, Any],
    *,
    options: BenchOptions,
    started_at: float,
    environment: dict[str, Any],
) -> dict[str, Any]:
    """Add the direct-versus-Nexus comparisons and the goal verdicts to the results."""
    direct = results["direct"]
    servers = {name: data for name, data in results.items() if name != "direct"}
    comparisons = {name: _compare(direct, data) for name, data in servers.items()}
    goals = [
        verdict
        for name in servers
        for verdict in _judge(name, servers[name], comparisons[name])
    ]
    return {
        "schema": SCHEMA_VERSION,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started_at)),
        "environment": environment,
        "method": METHOD,
        "options": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in asdict(options).items()
        },
        "direct": direct,
        "servers": servers,
        "comparison": comparisons,
        "goals": goals,
    }


def _compare(direct: dict[str, Any], via: dict[str, Any]) -> dict[str, Any]:
    chat = {}
    for concurrency, cell in via["chat"].items():
        base = direct["chat"][concurrency]
        chat[concurrency] = {
            "added_p50_ms": _minus(
                cell["latency_ms"]["p50"], base["latency_ms"]["p50"]
            ),
            "added_p99_ms": _minus(
                cell["latency_ms"]["p99"], base["latency_ms"]["p99"]
            ),
            "throughput_ratio": round(
                cell["requests_per_s"] / base["requests_per_s"], 3
            )
            if base["requests_per_s"]
            else None,
        }
    stream = {}
    for concurrency, cell in via["stream"].items():
        base = direct["stream"][concurrency]
        stream[concurrency] = {
            "ttfb_overhead_p50_ms": _minus(
                cell["ttfb_ms"]["p50"], base["ttfb_ms"]["p50"]
            ),
            "ttfb_overhead_p99_ms": _minus(
                cell["ttfb_ms"]["p99"], base["ttfb_ms"]["p99"]
            ),
            "throughput_ratio": round(cell["streams_per_s"] / base["streams_per_s"], 3)
            if base["streams_per_s"]
            else None,
        }
    return {"chat": chat, "stream": stream}


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _judge(
    server: str, data: dict[str, Any], comparison: dict[str, Any]
) -> list[dict[str, Any]]:
    chat, stream = data["chat"], data["stream"]
    stream_cell = stream.get(GOAL_STREAM_CONCURRENCY)
    stream_comparison = comparison["stream"].get(GOAL_STREAM_CONCURRENCY)
    found: dict[str, tuple[float | None, int]] = {
        "added_p50_c1": (
            comparison["chat"].get("1", {}).get("added_p50_ms"),
            chat.get("1", {}).get("errors", 0),
        ),
        "rps_c16": (
            chat.get("16", {}).get("requests_per_s"),
            chat.get("16", {}).get("errors", 0),
        ),
        "ttfb_overhead": (
            stream_comparison["ttfb_overhead_p50_ms"] if stream_comparison else None,
            stream_cell["errors"] if stream_cell else 0,
        ),
        "peak_rss": (round(data["peak_rss_kib"] * 1024 / 1e6, 1), 0),
    }
    verdicts = []
    for key, (value, errors) in found.items():
        goal = GOALS[key]
        if value is None:
            status = "NOT MEASURED"
        elif errors:
            status = "MISS (errors)"
        else:
            status = "PASS" if goal.is_met(value) else "MISS"
        verdicts.append(
            {
                "server": server,
                "goal": goal.name,
                "target": goal.target,
                "value": value,
                "unit": goal.unit,
                "status": status,
            }
        )
    return verdicts


def write_json(report: dict[str, Any], directory: Path) -> Path:
    """Write the report as bench-<time>.json (and latest.json) under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2) + "\n"
    stamp = report["started_at"][:19].replace(":", "").replace("-", "")
    path = directory / f"bench-{stamp}.json"
    path.write_text(text)
    (directory / "latest.json").write_text(text)
    return path


def format_report(report: dict[str, Any]) -> str:
    """The human summary: environment, method, results table and goal verdicts."""
    env = report["environment"]
    method = report["method"]
    lines = [
        f"Nexus proxy benchmark, {report['started_at']}",
        (
            f"  settings: {env['settings']}; {env['cpus']} CPUs; load average "
            f"{_loads(env['loadavg_start'])} at start, "
            f"{_loads(env['loadavg_end'])} at end"
        ),
        (
            f"  Python {env['python']}, Daphne {env['daphne']}, "
            f"uvicorn {env['uvicorn']}, {env['wrk']}"
        ),
        f"  pinning: {env['pinning']}",
        *_busy_warning(env),
        f"  {report['options']['duration']} s per measurement",
        f"  throughput: {method['throughput']}",
        f"  latency: {method['latency']}",
        "",
        "Non-stream chat completions",
    ]
    rows: list[list[str]] = [
        ["c", "target", "req/s", "ratio", "p50 ms", "+p50", "p99 ms", "+p99"]
        + ["Little ms", "errors", "server CPU", "mock CPU", "CPU ms/req"]
    ]
    targets = ["direct", *report["servers"]]
    direct = report["direct"]
    for concurrency in direct["chat"]:
        for target in targets:
            data = direct if target == "direct" else report["servers"][target]
            cell = data["chat"][concurrency]
            compared = (
                report["comparison"][target]["chat"][concurrency]
                if target != "direct"
                else {}
            )
            latency = cell["latency_ms"]
            rows.append(
                [
                    concurrency if target == "direct" else "",
                    "mock (direct)" if target == "direct" else f"via {target}",
                    f"{cell['requests_per_s']:,.0f}",
                    _number(compared.get("throughput_ratio"), "{:.2f}"),
                    _number(latency["p50"]),
                    _number(compared.get("added_p50_ms"), "{:+.2f}"),
                    _number(latency["p99"]),
                    _number(compared.get("added_p99_ms"), "{:+.2f}"),
                    _number(cell["implied_mean_ms"]),
                    str(cell["errors"]),
                    _percent(cell["cpu_percent"].get("server")),
                    _percent(cell["cpu_percent"].get("mock")),
                    _cost(cell),
                ]
            )
    lines += _table(rows)
    lines += [
        "  ratio: throughput via Nexus / direct. +p50, +p99: latency added by Nexus.",
        "  Little ms: mean latency implied by req/s (c / rate), to cross-check.",
        (
            "  CPU: busy share of one CPU; CPU ms/req: CPU time per request of the "
            "serving process (direct: the mock's)."
        ),
        "",
        "Streaming chat completions (" + report["method"]["streaming"] + ")",
    ]
    rows = [
        ["c", "target", "streams/s", "ratio", "TTFB p50", "+p50", "TTFB p99", "+p99"]
        + ["stream p50", "stream p99", "errors", "server CPU", "CPU ms/req"]
    ]
    for concurrency in direct["stream"]:
        for target in targets:
            data = direct if target == "direct" else report["servers"][target]
            cell = data["stream"][concurrency]
            compared = (
                report["comparison"][target]["stream"][concurrency]
                if target != "direct"
                else {}
            )
            rows.append(
                [
                    concurrency if target == "direct" else "",
                    "mock (direct)" if target == "direct" else f"via {target}",
                    f"{cell['streams_per_s']:,.0f}",
                    _number(compared.get("throughput_ratio"), "{:.2f}"),
                    _number(cell["ttfb_ms"]["p50"]),
                    _number(compared.get("ttfb_overhead_p50_ms"), "{:+.2f}"),
                    _number(cell["ttfb_ms"]["p99"]),
                    _number(compared.get("ttfb_overhead_p99_ms"), "{:+.2f}"),
                    _number(cell["stream_ms"]["p50"]),
                    _number(cell["stream_ms"]["p99"]),
                    str(cell["errors"]),
                    _percent(cell["cpu_percent"].get("server")),
                    _cost(cell),
                ]
            )
    lines += _table(rows)
    lines += ["", "Memory of the serving process"]
    rows = [["server", "RSS after warm-up", "RSS at end", "peak RSS (VmHWM)"]]
    for name, data in report["servers"].items():
        rows.append(
            [
                name,
                _megabytes(data["rss_after_warmup_kib"]),
                _megabytes(data["rss_end_kib"]),
                _megabytes(data["peak_rss_kib"]),
            ]
        )
    lines += _table(rows)
    lines += ["", "Goals (issue 6)"]
    rows = [["server", "goal", "target", "measured", "verdict"]]
    for verdict in report["goals"]:
        value = verdict["value"]
        rows.append(
            [
                verdict["server"],
                verdict["goal"],
                verdict["target"],
                "-" if value is None else f"{value:,.2f} {verdict['unit']}",
                verdict["status"],
            ]
        )
    lines += _table(rows)
    for name, data in report["servers"].items():
        profile = data.get("profile")
        if profile:
            where = profile.get("flamegraph") or f"failed: {profile.get('error')}"
            lines.append(f"Profile of {name} under c=16: {where}")
    return "\n".join(lines)


def _cost(cell: dict[str, Any]) -> str:
    costs = cell["cpu_ms_per_request"]
    return _number(costs.get("server", costs.get("mock")), "{:.3f}")


def _busy_warning(env: dict[str, Any]) -> list[str]:
    """Say so when other processes were competing for the CPUs."""
    before = env["loadavg_start"][0]
    if before < env["cpus"] * BUSY_LOAD_SHARE:
        return []
    return [
        (
            f"  WARNING: the machine was busy before the run (load average {before:.1f}"
            f" on {env['cpus']} CPUs). Other processes took CPU time"
        ),
        (
            "  from the measured ones, so rates and latencies are worse than on an "
            "idle machine; CPU ms/req is not affected."
        ),
    ]


def _table(rows: list[list[Any]]) -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    align: list[Callable[[str, int], str]] = [
        (lambda text, width: text.ljust(width))
        if i == 1
        else (lambda text, width: text.rjust(width))
        for i in range(len(widths))
    ]
    return [
        "  " + "  ".join(align[i](cell, widths[i]) for i, cell in enumerate(row))
        for row in cells
    ]


def _number(value: float | None, form: str = "{:.2f}") -> str:
    return "-" if value is None else form.format(value)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _megabytes(kib: int) -> str:
    return f"{kib * 1024 / 1e6:.1f} MB"


def _loads(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)
