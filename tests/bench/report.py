"""The benchmark report: comparisons, goals, the printed tables and the JSON file."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.bench.goals import judge_goals, ratio
from tests.bench.surfaces import surface_lines

if TYPE_CHECKING:
    from tests.bench.plan import BenchOptions

SCHEMA_VERSION = 2
# A load average above this share of the CPUs before the run means that other
# processes compete for them.
BUSY_LOAD_SHARE = 0.5
METHOD = {
    "throughput": "wrk 4.1 (C, closed loop, keep-alive); at c=16/64 plus the probe",
    "latency": "raw per-request samples from a keep-alive probe client (Python "
    "asyncio on uvloop, plain sockets), never wrk's (coordinated-omission "
    "corrected) percentiles: at c=1 one sequential probe connection alone; at "
    "c=16/64 the probe holds c/4 of the c connections while wrk holds the rest",
    "streaming": "time to the first SSE data line (TTFB) and to the end of the "
    "stream from a Python asyncio client that starts new streams at a fixed "
    "rate (open loop, keep-alive connections, raw samples); closed-loop "
    "streams/s from wrk at c=8",
    "targets": "bare-daphne: Daphne as it comes serving a constant ~350-byte "
    "JSON reply (the ceiling of one Daphne process here); daphne, uvicorn, "
    "granian: Nexus in one serving process; NAME-xN: Nexus in N processes on "
    "one port, started as nexus_run starts them; litellm: LiteLLM's proxy, one "
    "worker, on the same mock (make bench-peers)",
    "multi-process": "not pinned (they need every "
    "CPU, which they share with the mock and wrk), are loaded by wrk alone "
    "(no latency probe: a Python client would take their CPU) and their CPU "
    "and memory are summed over every process",
    "resources": "CPU time (utime+stime) and memory (VmRSS, peak VmHWM) from "
    "/proc, over each target's whole process tree (granian's workers are child "
    "processes)",
}


def summarize_ns(samples_ns: Sequence[int]) -> dict[str, float | int | None]:
    """Percentiles (nearest rank) of raw samples, in milliseconds."""
    if not samples_ns:
        return {
            "samples": 0,
            "mean": None,
            "p50": None,
            "p90": None,
            "p99": None,
            "max": None,
        }
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
    """Add the comparisons with the direct run and the goal verdicts to the results."""
    direct = results["direct"]
    servers = {name: data for name, data in results.items() if name != "direct"}
    comparisons = {name: _compare(direct, data) for name, data in servers.items()}
    return {
        "schema": SCHEMA_VERSION,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started_at)),
        "environment": environment,
        "method": METHOD,
        "options": _plain(asdict(options)),
        "direct": direct,
        "servers": servers,
        "comparison": comparisons,
        "goals": judge_goals(servers, comparisons),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return str(value) if isinstance(value, Path) else value


def _compare(direct: dict[str, Any], via: dict[str, Any]) -> dict[str, Any]:
    chat = {}
    for concurrency, cell in via["chat"].items():
        base = direct["chat"].get(concurrency)
        if base is None:
            continue
        chat[concurrency] = {
            "added_p50_ms": _minus(
                cell["latency_ms"]["p50"], base["latency_ms"]["p50"]
            ),
            "added_p99_ms": _minus(
                cell["latency_ms"]["p99"], base["latency_ms"]["p99"]
            ),
            "throughput_ratio": ratio(cell["requests_per_s"], base["requests_per_s"]),
        }
    stream = {
        concurrency: {
            "throughput_ratio": ratio(
                cell["streams_per_s"], direct["stream"][concurrency]["streams_per_s"]
            )
        }
        for concurrency, cell in via["stream"].items()
        if concurrency in direct["stream"]
    }
    paced, base_paced = via.get("paced_stream"), direct.get("paced_stream")
    paced_comparison = None
    if paced and base_paced:
        paced_comparison = {
            "ttfb_added_p50_ms": _minus(
                paced["ttfb_ms"]["p50"], base_paced["ttfb_ms"]["p50"]
            ),
            "ttfb_added_p99_ms": _minus(
                paced["ttfb_ms"]["p99"], base_paced["ttfb_ms"]["p99"]
            ),
        }
    return {"chat": chat, "stream": stream, "paced_stream": paced_comparison}


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


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
    """The human summary: environment, method, results tables and goal verdicts."""
    env = report["environment"]
    method = report["method"]
    litellm = f", LiteLLM {env['litellm']}" if env.get("litellm") else ""
    lines = [
        f"Nexus proxy benchmark, {report['started_at']}",
        (
            f"  settings: {env['settings']}; {env['cpus']} CPUs; load average "
            f"{_loads(env['loadavg_start'])} at start, "
            f"{_loads(env['loadavg_end'])} at end"
        ),
        (
            f"  Python {env['python']}, Daphne {env['daphne']}, "
            f"uvicorn {env['uvicorn']}, granian {env['granian']}{litellm}, "
            f"{env['wrk']}"
        ),
        f"  pinning: {env['pinning']}",
        *_busy_warning(env),
        (
            f"  {report['options']['duration']} s per measurement; run took "
            f"{env['elapsed_s']} s (estimated {env['estimated_s']} s)"
        ),
        f"  throughput: {method['throughput']}",
        f"  latency: {method['latency']}",
        f"  multi-process targets: {method['multi-process']}",
        "",
        "Non-stream chat completions",
    ]
    lines += _chat_table(report)
    lines += [
        "  ratio: throughput / direct. +p50, +p99: latency added over direct.",
        "  Little ms: mean latency implied by req/s (c / rate), to cross-check.",
        (
            "  CPU: busy share of one CPU, summed over the target's processes; "
            "CPU ms/req: the target's CPU time per request (direct: the mock's); "
            "host busy: share of all CPUs in use (anyone's)."
        ),
        "",
        "Streaming chat completions, new streams at a fixed rate (open loop)",
    ]
    lines += _paced_table(report)
    if any(data["stream"] for data in report["servers"].values()):
        lines += ["", "Streaming chat completions, closed loop (wrk)"]
        lines += _stream_table(report)
    lines += surface_lines(report)
    lines += ["", "Processes and memory"]
    lines += _process_table(report)
    lines += ["", "Goals (issue 11)"]
    rows = [["target", "goal", "target value", "measured", "verdict", "note"]]
    for verdict in report["goals"]:
        value = verdict["value"]
        unit = verdict["unit"]
        measured = (
            "-"
            if value is None
            else f"{value:,.2f}x"
            if unit == "x"
            else f"{value:,.2f} {unit}"
        )
        rows.append(
            [
                verdict["server"],
                verdict["goal"],
                verdict["target"],
                measured,
                verdict["status"],
                verdict["note"],
            ]
        )
    lines += _table(rows, left=range(6))
    for name, data in report["servers"].items():
        if "profile" in data:
            lines += ["", *_profile_lines(name, data["profile"])]
    return "\n".join(lines)


def _chat_table(report: dict[str, Any]) -> list[str]:
    rows: list[list[str]] = [
        ["c", "target", "req/s", "ratio", "p50 ms", "+p50", "p99 ms", "+p99"]
        + ["Little ms", "errors", "server CPU", "mock CPU", "CPU ms/req", "host busy"]
    ]
    targets = {"direct": report["direct"], **report["servers"]}
    concurrencies = sorted({int(c) for data in targets.values() for c in data["chat"]})
    for concurrency in map(str, concurrencies):
        first = True
        for name, data in targets.items():
            cell = data["chat"].get(concurrency)
            if cell is None:
                continue
            compared = (
                report["comparison"][name]["chat"].get(concurrency, {})
                if name != "direct"
                else {}
            )
            latency = cell["latency_ms"]
            rows.append(
                [
                    concurrency if first else "",
                    _label(name),
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
                    _percent(cell.get("machine_busy_percent")),
                ]
            )
            first = False
    return _table(rows)


def _paced_table(report: dict[str, Any]) -> list[str]:
    rows = [
        ["target", "streams/s", "TTFB p50", "+p50", "TTFB p99", "+p99"]
        + ["stream p50", "stream p99", "errors", "max lag ms", "CPU ms/stream"]
    ]
    targets = {"direct": report["direct"], **report["servers"]}
    for name, data in targets.items():
        cell = data.get("paced_stream")
        if not cell:
            continue
        compared = (
            report["comparison"][name].get("paced_stream") or {}
            if name != "direct"
            else {}
        )
        rows.append(
            [
                _label(name),
                f"{cell['streams_per_s']:,.1f}",
                _number(cell["ttfb_ms"]["p50"]),
                _number(compared.get("ttfb_added_p50_ms"), "{:+.2f}"),
                _number(cell["ttfb_ms"]["p99"]),
                _number(compared.get("ttfb_added_p99_ms"), "{:+.2f}"),
                _number(cell["stream_ms"]["p50"]),
                _number(cell["stream_ms"]["p99"]),
                str(cell["errors"]),
                _number(cell["max_lag_ms"]),
                _cost(cell),
            ]
        )
    return _table(rows, left=(0,)) + [
        "  max lag: how far behind its schedule the client started a stream."
    ]


def _stream_table(report: dict[str, Any]) -> list[str]:
    rows = [["c", "target", "streams/s", "ratio", "errors", "server CPU"]]
    rows[0].append("CPU ms/stream")
    targets = {"direct": report["direct"], **report["servers"]}
    for concurrency in report["direct"]["stream"]:
        first = True
        for name, data in targets.items():
            cell = data["stream"].get(concurrency)
            if cell is None:
                continue
            compared = (
                report["comparison"][name]["stream"].get(concurrency, {})
                if name != "direct"
                else {}
            )
            rows.append(
                [
                    concurrency if first else "",
                    _label(name),
                    f"{cell['streams_per_s']:,.0f}",
                    _number(compared.get("throughput_ratio"), "{:.2f}"),
                    str(cell["errors"]),
                    _percent(cell["cpu_percent"].get("server")),
                    _cost(cell),
                ]
            )
            first = False
    return _table(rows)


def _process_table(report: dict[str, Any]) -> list[str]:
    rows = [
        ["target", "processes", "pinned", "requests", "RSS after warm-up"]
        + ["RSS at end", "peak RSS per process", "CPU c=16 by process"]
    ]
    for name, data in report["servers"].items():
        about = data["target"]
        c16 = data["chat"].get("16", {})
        shares = c16.get("server_cpu_percent_by_process", {})
        rows.append(
            [
                name,
                str(len(data["processes"])),
                "yes" if about["pinned"] else "no",
                f"{data['requests']:,}",
                _megabytes(data["rss_after_warmup_kib"]),
                _megabytes(data["rss_end_kib"]),
                _megabytes(data["peak_rss_kib"]),
                " + ".join(f"{share:.0f}%" for share in shares.values())
                if len(shares) > 1
                else "",
            ]
        )
    return _table(rows, left=(0, 2)) + [
        "  RSS: summed over the target's processes; peak: the largest VmHWM of one.",
    ]


def _profile_lines(name: str, profile: dict[str, Any]) -> list[str]:
    if "error" in profile:
        return [f"Profile of {name} under c=16 failed: {profile['error']}"]
    lines = [
        (
            f"Profile of {name} under c=16: {profile['samples']:,} samples, "
            f"{profile['file']}"
        ),
        "  top frames by self time (% of samples, taken while holding the GIL):",
    ]
    lines += [f"    {f['percent']:5.1f}  {f['frame']}" for f in profile["top_self"]]
    lines.append(
        "  top frames by inclusive time (% of samples; the entry chain, "
        f"{len(profile['trunk'])} frames that each call one frame only, is left "
        "out and listed in the JSON):"
    )
    lines += [
        f"    {f['percent']:5.1f}  {f['frame']}" for f in profile["top_inclusive"]
    ]
    return lines


def _label(name: str) -> str:
    return "mock (direct)" if name == "direct" else name


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


def _table(rows: list[list[Any]], left: Collection[int] = (1,)) -> list[str]:
    """Align columns: those in ``left`` to the left, the rest (numbers) right."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    align: list[Callable[[str, int], str]] = [
        (lambda text, width: text.ljust(width))
        if i in left
        else (lambda text, width: text.rjust(width))
        for i in range(len(widths))
    ]
    return [
        (
            "  " + "  ".join(align[i](cell, widths[i]) for i, cell in enumerate(row))
        ).rstrip()
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


LATENCY_TABLE_HEAD = (
    "| {} | p50 | p90 | samples | errors | CPU per request | req/s (wrk c=16) |",
    "|---|---|---|---|---|---|---|",
)


def latency_table(first_column: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    """A markdown table of raw c=1 latency, CPU per request and wrk's rate,
    a row per measured target (``--cache``, ``--tracing``)."""
    lines = [LATENCY_TABLE_HEAD[0].format(first_column), LATENCY_TABLE_HEAD[1]]
    for name, row in rows.items():
        rps = f"{row['rps']:.0f}" if "rps" in row else "-"
        lines.append(
            f"| {name} | {row['p50_ms']:.3f} ms | {row['p90_ms']:.3f} ms | "
            f"{row['samples']} | {row['errors']} | "
            f"{row['cpu_us_per_request']:.0f} µs | {rps} |"
        )
    return lines
