"""The fleet benchmark: cold loads and total time per strategy on a mixed fleet.

``make bench BENCH_ARGS=--fleet``. Three mock Ollama nodes: one large (16 GB
of memory) and two small (7 GB), each with 2 slots, a 2 s cold load and
400 ms per request, every node listing every model. Six models from 1 to
8 GB with a skewed mix (the small ones popular, as in practice). The same
seeded open-loop workload (Poisson arrivals) runs under each strategy with
fresh nodes (nothing loaded); the report gives the mean and p95 total time
(client-side, request to answer) and the cold loads per 100 requests that
the nodes counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from django.db import connection, transaction

from backends.discovery import discover_models
from backends.models import Backend, HealthStatus
from routing.models import RoutingPolicy
from tests.bench.processes import start_daphne
from usage.models import ApiKey

# (model, size in GB, share of requests)
MODELS = (
    ("fleet-8b", 3.0, 0.35),
    ("fleet-3b", 2.0, 0.22),
    ("fleet-14b", 4.0, 0.15),
    ("fleet-1b", 1.0, 0.12),
    ("fleet-32b", 6.0, 0.10),
    ("fleet-70b", 8.0, 0.06),
)
NODES = (
    ("fleet-large", 16.0, "large"),
    ("fleet-small-1", 7.0, "small"),
    ("fleet-small-2", 7.0, "small"),
)
SLOTS = 2
LOAD_SECONDS = 2.0
LATENCY_MS = 400
RATE = 3.0  # requests a second, on average
STRATEGIES = ("round_robin", "smart", "fleet")
# How often discovery reads /api/ps meanwhile, as Celery beat would.
DISCOVERY_SECONDS = 5.0
KEY_NAME = "bench-fleet"


def _workload(count: int, seed: int = 16) -> list[tuple[float, str]]:
    """(send at, model) pairs: Poisson arrivals, models drawn by their share."""
    rng = random.Random(seed)
    names = [name for name, _, _ in MODELS]
    weights = [share for _, _, share in MODELS]
    at = 0.0
    plan = []
    for _ in range(count):
        at += rng.expovariate(RATE)
        plan.append((at, rng.choices(names, weights)[0]))
    return plan


def _set_if_present(row: Any, **values: Any) -> None:
    """Set the fleet fields this version of the models has (others skipped)."""
    names = {field.name for field in row._meta.get_fields()}
    for name, value in values.items():
        if name in names:
            setattr(row, name, value)


@contextlib.contextmanager
def _rows(urls: list[str]) -> Iterator[str]:
    names = [name for name, _, _ in NODES]
    with transaction.atomic():
        Backend.objects.filter(name__in=names).delete()
        ApiKey.objects.filter(name=KEY_NAME).delete()
        for (name, memory, tier), url in zip(NODES, urls, strict=True):
            backend = Backend(
                name=name,
                base_url=url,
                kind="ollama",
                status=HealthStatus.HEALTHY,
                max_concurrency=SLOTS,
            )
            _set_if_present(backend, memory_ceiling_gb=memory, tier=tier)
            backend.save()
        _, key = ApiKey.objects.create_key(KEY_NAME)
    policy = RoutingPolicy.load()
    saved = policy.strategy
    try:
        yield key
    finally:
        policy = RoutingPolicy.load()
        policy.strategy = saved
        policy.save()
        Backend.objects.filter(name__in=names).delete()
        ApiKey.objects.filter(name=KEY_NAME).delete()


def _set_strategy(strategy: str) -> None:
    policy = RoutingPolicy.load()
    policy.strategy = strategy
    _set_if_present(
        policy,
        fleet_queue_timeout_seconds=300.0,
        fleet_queue_length=1000,
    )
    policy.full_clean()
    policy.save()


async def _run(base_url: str, key: str, plan: list[tuple[float, str]]) -> dict:
    timings: list[float] = []
    failures: dict[str, int] = {}
    # Per request, in plan order: when sent, model, backend, seconds, status.
    detail: list[dict[str, Any]] = [{} for _ in plan]

    async def one(client: httpx.AsyncClient, index: int, at: float, model: str) -> None:
        await asyncio.sleep(at)
        started = time.perf_counter()
        row = detail[index]
        row.update(at=round(at, 3), model=model)
        try:
            reply = await client.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": f"Bearer {key}"},
            )
        except httpx.HTTPError as error:
            failures[type(error).__name__] = failures.get(type(error).__name__, 0) + 1
            row["status"] = type(error).__name__
            return
        row.update(
            backend=reply.headers.get("x-nexus-backend", ""),
            seconds=round(time.perf_counter() - started, 3),
            status=reply.status_code,
        )
        if reply.status_code == 200:
            timings.append(time.perf_counter() - started)
        else:
            code = str(reply.status_code)
            failures[code] = failures.get(code, 0) + 1

    limits = httpx.Limits(max_connections=len(plan) + 10)
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=300.0, trust_env=False
    ) as client:
        await asyncio.gather(
            *(one(client, i, at, model) for i, (at, model) in enumerate(plan))
        )
    return {"timings": timings, "failures": failures, "requests": detail}


@contextlib.contextmanager
def _discovering() -> Iterator[None]:
    """Discover the nodes' loaded models every few seconds meanwhile."""
    stop = threading.Event()

    def loop() -> None:
        try:
            while not stop.wait(DISCOVERY_SECONDS):
                discover_models()
        finally:
            connection.close()

    thread = threading.Thread(target=loop, name="bench-discovery", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


def _node_args(name: str, memory: float) -> list[str]:
    args = ["--kind", "ollama", "--name", name, "--loaded-models", ""]
    for model, size, _ in MODELS:
        args += ["--model", f"{model}:{size:g}"]
    return args + [
        "--memory-gb",
        f"{memory:g}",
        "--slots",
        str(SLOTS),
        "--load-seconds",
        f"{LOAD_SECONDS:g}",
        "--latency-ms",
        str(LATENCY_MS),
    ]


def run_fleet_benchmark(
    env: dict[str, str],
    spawn_mock: Callable[..., Any],
    logs: Path,
    requests: int,
    progress: Callable[[str], None],
    strategies: tuple[str, ...] = STRATEGIES,
) -> dict[str, Any]:
    """Run the workload under each strategy; return timings and cold loads."""
    plan = _workload(requests)
    results: dict[str, Any] = {"requests": requests, "strategies": {}}
    for strategy in strategies:
        progress(f"fleet: {requests} requests under {strategy}")
        mocks = [spawn_mock(*_node_args(n, m), env=env) for n, m, _ in NODES]
        try:
            with _rows([m.base_url for m in mocks]) as key:
                discover_models()
                _set_strategy(strategy)
                server = start_daphne(env, logs)
                try:
                    with _discovering():
                        outcome = asyncio.run(_run(server.url, key, plan))
                finally:
                    server.stop()
                nodes = {
                    name: httpx.get(f"{m.base_url}/_mock/stats").json()
                    for (name, _, _), m in zip(NODES, mocks, strict=True)
                }
        finally:
            for mock in mocks:
                mock.stop()
        timings = outcome["timings"]
        loads = sum(node["loads_total"] for node in nodes.values())
        waited = sum(node["cold_starts"] for node in nodes.values())
        results["strategies"][strategy] = {
            "served": len(timings),
            "failures": outcome["failures"],
            "mean_s": sum(timings) / len(timings) if timings else float("nan"),
            "p95_s": _pct(timings, 95),
            "cold_loads": loads,
            "cold_loads_per_100": 100 * loads / requests,
            "cold_starts_per_100": 100 * waited / requests,
            "nodes": {
                name: {
                    key: node[key]
                    for key in ("loads", "cold_starts", "evictions_total")
                }
                for name, node in nodes.items()
            },
            "requests": outcome["requests"],
        }
    return results


def _pct(samples: list[float], pct: int) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def format_fleet_report(results: dict[str, Any]) -> str:
    runs = results["strategies"]
    lines = [
        (
            f"{results['requests']} requests at {RATE:g}/s over {len(MODELS)} models "
            f"(skewed); 3 mock Ollama nodes (16, 7, 7 GB; {SLOTS} slots; "
            f"{LOAD_SECONDS:g} s cold load; {LATENCY_MS} ms per request)"
        ),
        "",
        (
            "| strategy | served | failed | mean total | p95 total | cold loads / 100 "
            "| requests that waited for a load / 100 |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for strategy, run in runs.items():
        failed = sum(run["failures"].values())
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(run["failures"].items()))
        lines.append(
            f"| {strategy} | {run['served']} | {failed}"
            f"{f' ({detail})' if detail else ''} | {run['mean_s']:.2f} s"
            f" | {run['p95_s']:.2f} s | {run['cold_loads_per_100']:.1f}"
            f" | {run['cold_starts_per_100']:.1f} |"
        )
    if "smart" in runs and "fleet" in runs:
        smart, fleet = runs["smart"], runs["fleet"]
        loads_cut = 1 - fleet["cold_loads"] / max(smart["cold_loads"], 1)
        time_cut = 1 - fleet["mean_s"] / smart["mean_s"]
        lines += [
            "",
            (
                f"Goal: fleet cuts cold loads >= 80 % vs smart: {loads_cut:.0%} "
                f"({'PASS' if loads_cut >= 0.8 else 'MISS'})"
            ),
            (
                f"Goal: fleet cuts mean total time >= 50 % vs smart: {time_cut:.0%} "
                f"({'PASS' if time_cut >= 0.5 else 'MISS'})"
            ),
        ]
    return "\n".join(lines)
