"""Issue 11's goals: which targets they apply to, and their verdicts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tests.bench.processes import BARE_DAPHNE, LITELLM


@dataclass(frozen=True, slots=True)
class Goal:
    """One target from issue 11, checked for the serving targets it names."""

    name: str
    unit: str
    limit: float
    at_most: bool  # True: the value must be <= limit; False: >= limit

    @property
    def target(self) -> str:
        limit = f"{self.limit:,.0f}" if self.limit >= 100 else f"{self.limit:g}"
        unit = self.unit if self.unit == "x" else f" {self.unit}"
        return f"{'<=' if self.at_most else '>='} {limit}{unit}"

    def is_met(self, value: float) -> bool:
        return value <= self.limit if self.at_most else value >= self.limit


GOALS = {
    "rps_c16_daphne": Goal("throughput, chat c=16", "req/s", 2000.0, at_most=False),
    "vs_bare": Goal("throughput c=16 / bare-daphne's", "x", 0.6, at_most=False),
    "vs_litellm": Goal("throughput c=16 / LiteLLM's", "x", 10.0, at_most=False),
    "added_p50_c1": Goal("added p50 latency, chat c=1", "ms", 0.8, at_most=True),
    "p99_c1": Goal("p99 latency, chat c=1", "ms", 3.0, at_most=True),
    "rps_c16_uvicorn": Goal("throughput, chat c=16", "req/s", 3000.0, at_most=False),
    "cpu_per_request": Goal(
        "server CPU per request, chat c=16", "ms", 0.5, at_most=True
    ),
    "ttfb_paced": Goal("added streaming TTFB p50, paced 40/s", "ms", 1.5, at_most=True),
    "multi_speedup": Goal("throughput c=16 / one process's", "x", 1.7, at_most=False),
    "peak_rss": Goal("peak RSS per serving process", "MB", 150.0, at_most=True),
}
# Which goals apply to one process of Nexus under each server.
SINGLE_PROCESS_GOALS = {
    "daphne": (
        "rps_c16_daphne",
        "vs_bare",
        "vs_litellm",
        "added_p50_c1",
        "p99_c1",
        "cpu_per_request",
        "ttfb_paced",
        "peak_rss",
    ),
    "uvicorn": ("rps_c16_uvicorn", "cpu_per_request", "ttfb_paced", "peak_rss"),
    "granian": ("cpu_per_request", "ttfb_paced", "peak_rss"),
}
MULTI_PROCESS_GOALS = ("multi_speedup", "peak_rss")


def judge_goals(
    servers: dict[str, Any], comparisons: dict[str, Any]
) -> list[dict[str, Any]]:
    """Issue 11's goals for every measured target they apply to."""
    verdicts = []
    for name, data in servers.items():
        about = data["target"]
        if about["role"] != "nexus":
            continue
        if about["processes"] > 1:
            keys: Sequence[str] = MULTI_PROCESS_GOALS
        else:
            keys = SINGLE_PROCESS_GOALS.get(about["server"], ())
        for key in keys:
            if key == "vs_litellm" and LITELLM not in servers:
                continue  # only when measured (make bench-peers)
            value, errors, note = _measure_goal(key, name, servers, comparisons)
            verdicts.append(_verdict(name, GOALS[key], value, errors, note))
    return verdicts


def _measure_goal(
    key: str, name: str, servers: dict[str, Any], comparisons: dict[str, Any]
) -> tuple[float | None, int, str]:
    """Return the goal's value for target ``name``, its errors and a note."""
    data = servers[name]
    c16 = data["chat"].get("16", {})
    if key in ("rps_c16_daphne", "rps_c16_uvicorn"):
        return c16.get("requests_per_s"), c16.get("errors", 0), ""
    if key in ("vs_bare", "vs_litellm", "multi_speedup"):
        other = {
            "vs_bare": BARE_DAPHNE,
            "vs_litellm": LITELLM,
            "multi_speedup": data["target"]["server"],
        }[key]
        base = servers.get(other, {}).get("chat", {}).get("16")
        if base is None:
            return None, 0, f"{other} not measured in this run"
        value = ratio(c16.get("requests_per_s"), base["requests_per_s"])
        note = f"against {other}"
        if key == "multi_speedup":
            # On few cores the clients and the mock take a share the servers lack.
            note += f"; machine {c16.get('machine_busy_percent', 0):.0f}% busy"
        return value, c16.get("errors", 0) + base["errors"], note
    if key == "added_p50_c1":
        c1 = data["chat"].get("1", {})
        added = comparisons[name]["chat"].get("1", {}).get("added_p50_ms")
        return added, c1.get("errors", 0), ""
    if key == "p99_c1":
        c1 = data["chat"].get("1", {})
        return c1.get("latency_ms", {}).get("p99"), c1.get("errors", 0), "raw"
    if key == "cpu_per_request":
        cost = c16.get("cpu_ms_per_request", {}).get("server")
        return cost, c16.get("errors", 0), ""
    if key == "ttfb_paced":
        paced = data.get("paced_stream") or {}
        compared = comparisons[name].get("paced_stream") or {}
        return compared.get("ttfb_added_p50_ms"), paced.get("errors", 0), ""
    if key == "peak_rss":
        processes = len(data.get("processes", ()))
        note = f"largest of {processes} processes" if processes > 1 else ""
        return round(data["peak_rss_kib"] * 1024 / 1e6, 1), 0, note
    raise KeyError(key)


def _verdict(
    name: str, goal: Goal, value: float | None, errors: int, note: str
) -> dict[str, Any]:
    if value is None:
        status = "NOT MEASURED"
    elif errors:
        status = "MISS (errors)"
    else:
        status = "PASS" if goal.is_met(value) else "MISS"
    return {
        "server": name,
        "goal": goal.name,
        "target": goal.target,
        "value": value,
        "unit": goal.unit,
        "status": status,
        "note": note,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` to three decimals, or None when either is missing (or b is 0)."""
    return round(a / b, 3) if a is not None and b else None
