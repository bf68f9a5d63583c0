"""The fleet benchmark's two variants: a node joining mid-run, mixed prompt sizes.

``make bench BENCH_ARGS=--fleet-variants``.

*A node joins*: the fleet benchmark's nodes, models and workload under the
fleet strategy, with the large node disabled until a third of the requests
have been sent, then enabled (as an operator would, or a relay worker
registering). Reported per phase (sent before / after it joined): requests,
mean and p95 total time, and the share the new node served afterwards.

*Mixed sizes*: one model on 2 mock backends with 4 slots each, 100 ms per
request plus 100 ms per 1,000 prompt tokens (a prefill), prompts of 50, 500,
2,000 and 8,000 tokens (40 / 30 / 20 / 10 %) arriving at 90 % of the
fleet's capacity (Poisson, seeded); admission control counts its stock in
requests (watermark 4 per backend), then in tokens with the default
watermark (4 x 2 x 256 = 2,048 tokens per backend: sized for requests of
512 tokens), then in tokens with a watermark sized for this mix (4 slots x
the mean request, 1,400 tokens: 5,600 per backend). Reported per size class:
p50 / p95 total time, and the wait (total time less the mock's own time for
that size), with the refusals by status.
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
from django.db import transaction

from backends.discovery import discover_models
from backends.models import Backend, BackendModel, HealthStatus
from routing.models import RoutingPolicy
from tests.bench.fleet import (
    NODES,
    _discovering,
    _node_args,
    _pct,
    _rows,
    _run,
    _set_strategy,
    _workload,
)
from tests.bench.processes import start_daphne
from usage.models import ApiKey

JOINING = "fleet-large"

SIZE_MODEL = "nexus-bench-sizes"
SIZE_SLOTS = 4
SIZE_BACKENDS = 2
SIZE_LATENCY_MS = 100
SIZE_PREFILL_MS = 100  # per 1,000 prompt tokens
SIZES = ((50, 0.4), (500, 0.3), (2000, 0.2), (8000, 0.1))
SIZE_LOAD = 0.9  # of the fleet's capacity
SIZE_KEY = "bench-sizes"
# (label, stock unit, watermark_tokens_per_backend or None for the default)
SIZE_RUNS = (
    ("requests", "requests", None),
    ("tokens, default watermark", "tokens", None),
    ("tokens, watermark 5,600", "tokens", 5600),
)


def _join_later(at: float, started: float, stop: threading.Event) -> threading.Thread:
    """Enable the joining node `at` seconds after `started` (a save: the
    configuration version moves and every process sees it)."""

    def join() -> None:
        if stop.wait(max(0.0, started + at - time.monotonic())):
            return
        backend = Backend.objects.get(name=JOINING)
        backend.enabled = True
        backend.save()
        discover_models()

    thread = threading.Thread(target=join, name="bench-join", daemon=True)
    thread.start()
    return thread


def run_join(
    env: dict[str, str],
    spawn_mock: Callable[..., Any],
    logs: Path,
    requests: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """The fleet workload with the large node joining a third of the way in."""
    plan = _workload(requests)
    join_at = plan[len(plan) // 3][0]
    progress(f"fleet variants: {requests} requests, {JOINING} joins at {join_at:.0f} s")
    mocks = [spawn_mock(*_node_args(n, m), env=env) for n, m, _ in NODES]
    try:
        with _rows([m.base_url for m in mocks]) as key:
            Backend.objects.filter(name=JOINING).update(enabled=False)
            discover_models()
            _set_strategy("fleet")
            server = start_daphne(env, logs)
            stop = threading.Event()
            try:
                with _discovering():
                    joiner = _join_later(join_at, time.monotonic(), stop)
                    outcome = asyncio.run(_run(server.url, key, plan))
                    stop.set()
                    joiner.join(30)
            finally:
                server.stop()
    finally:
        for mock in mocks:
            mock.stop()
    phases: dict[str, Any] = {}
    for phase, rows in (
        ("before", [r for r in outcome["requests"] if r.get("at", 0) < join_at]),
        ("after", [r for r in outcome["requests"] if r.get("at", 0) >= join_at]),
    ):
        seconds = [r["seconds"] for r in rows if r.get("status") == 200]
        phases[phase] = {
            "requests": len(rows),
            "failed": len(rows) - len(seconds),
            "mean_s": sum(seconds) / len(seconds) if seconds else float("nan"),
            "p95_s": _pct(seconds, 95),
            "on_new_node": sum(1 for r in rows if r.get("backend") == JOINING),
        }
    # Requests sent before the join and still unanswered when it came: did
    # the new node take any of them?
    waiting = [
        r
        for r in outcome["requests"]
        if r.get("at", 0) < join_at
        and r.get("status") == 200
        and r["at"] + r["seconds"] > join_at
    ]
    return {
        "requests": requests,
        "join_at_s": join_at,
        "phases": phases,
        "open_at_join": len(waiting),
        "open_at_join_on_new_node": sum(1 for r in waiting if r["backend"] == JOINING),
    }


def _size_plan(count: int, seed: int = 30) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    mean_tokens = sum(size * share for size, share in SIZES)
    service = (SIZE_LATENCY_MS + SIZE_PREFILL_MS * mean_tokens / 1000) / 1000
    rate = SIZE_LOAD * SIZE_SLOTS * SIZE_BACKENDS / service
    at, plan = 0.0, []
    sizes = [size for size, _ in SIZES]
    weights = [share for _, share in SIZES]
    for _ in range(count):
        at += rng.expovariate(rate)
        plan.append((at, rng.choices(sizes, weights)[0]))
    return plan


@contextlib.contextmanager
def _size_rows(urls: list[str]) -> Iterator[str]:
    names = [f"bench-sizes-{i}" for i in range(len(urls))]
    fields = (
        "admission_enabled",
        "admission_stock_unit",
        "admission_watermark_tokens_per_backend",
        "strategy",
    )
    policy = RoutingPolicy.load()
    saved = {name: getattr(policy, name) for name in fields}
    with transaction.atomic():
        Backend.objects.filter(name__in=names).delete()
        ApiKey.objects.filter(name=SIZE_KEY).delete()
        for name, url in zip(names, urls, strict=True):
            backend = Backend.objects.create(
                name=name, base_url=url, status=HealthStatus.HEALTHY
            )
            BackendModel.objects.create(backend=backend, name=SIZE_MODEL)
        _, key = ApiKey.objects.create_key(SIZE_KEY)
    try:
        yield key
    finally:
        policy = RoutingPolicy.load()
        for name, value in saved.items():
            setattr(policy, name, value)
        policy.save()
        Backend.objects.filter(name__in=names).delete()
        ApiKey.objects.filter(name=SIZE_KEY).delete()


def _set_stock_unit(unit: str, watermark_tokens: int | None) -> None:
    policy = RoutingPolicy.load()
    policy.strategy = "smart"
    policy.admission_enabled = True
    policy.admission_stock_unit = unit
    policy.admission_watermark_tokens_per_backend = watermark_tokens
    policy.admission_watermark_per_backend = float(SIZE_SLOTS)
    policy.full_clean()
    policy.save()


async def _send_sizes(
    base_url: str, key: str, plan: list[tuple[float, int]]
) -> list[tuple[int, float, int]]:
    """(size, seconds, status) per request."""
    results: list[tuple[int, float, int]] = []

    async def one(client: httpx.AsyncClient, at: float, size: int) -> None:
        await asyncio.sleep(at)
        content = "word " * (size * 4 // 5)  # size tokens by the bytes / 4 estimate
        started = time.perf_counter()
        try:
            reply = await client.post(
                "/v1/chat/completions",
                json={
                    "model": SIZE_MODEL,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 16,
                },
                headers={"authorization": f"Bearer {key}"},
            )
            status = reply.status_code
        except httpx.HTTPError:
            status = 0
        results.append((size, time.perf_counter() - started, status))

    limits = httpx.Limits(max_connections=len(plan) + 10)
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=300.0, trust_env=False
    ) as client:
        await asyncio.gather(*(one(client, at, size) for at, size in plan))
    return results


def run_sizes(
    env: dict[str, str],
    spawn_mock: Callable[..., Any],
    logs: Path,
    requests: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Mixed prompt sizes with the stock counted in requests, then in tokens."""
    plan = _size_plan(requests)
    runs: dict[str, Any] = {}
    for label, unit, watermark_tokens in SIZE_RUNS:
        progress(f"fleet variants: {requests} mixed-size prompts, stock in {label}")
        mocks = [
            spawn_mock(
                "--models",
                SIZE_MODEL,
                "--name",
                f"sizes-{i}",
                "--slots",
                str(SIZE_SLOTS),
                "--latency-ms",
                str(SIZE_LATENCY_MS),
                "--prefill-ms-per-1k-tokens",
                str(SIZE_PREFILL_MS),
                env=env,
            )
            for i in range(SIZE_BACKENDS)
        ]
        try:
            with _size_rows([m.base_url for m in mocks]) as key:
                _set_stock_unit(unit, watermark_tokens)
                server = start_daphne(env, logs)
                try:
                    results = asyncio.run(_send_sizes(server.url, key, plan))
                finally:
                    server.stop()
        finally:
            for mock in mocks:
                mock.stop()
        classes = {}
        for size, _ in SIZES:
            seconds = [s for z, s, status in results if z == size and status == 200]
            service = (SIZE_LATENCY_MS + SIZE_PREFILL_MS * size / 1000) / 1000
            failed: dict[str, int] = {}
            for z, _, status in results:
                if z == size and status != 200:
                    failed[str(status)] = failed.get(str(status), 0) + 1
            classes[str(size)] = {
                "served": len(seconds),
                "failed": failed,
                "p50_s": _pct(seconds, 50),
                "p95_s": _pct(seconds, 95),
                "wait_p50_s": max(0.0, _pct(seconds, 50) - service),
                "wait_p95_s": max(0.0, _pct(seconds, 95) - service),
            }
        runs[label] = classes
    return {"requests": requests, "runs": runs}


def run_fleet_variants(
    env: dict[str, str],
    spawn_mock: Callable[..., Any],
    logs: Path,
    requests: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    return {
        "join": run_join(env, spawn_mock, logs, requests, progress),
        "sizes": run_sizes(env, spawn_mock, logs, requests, progress),
    }


def format_fleet_variants_report(results: dict[str, Any]) -> str:
    join = results["join"]
    lines = [
        (
            f"A node joins: {join['requests']} requests under fleet, {JOINING} "
            f"enabled at {join['join_at_s']:.0f} s"
        ),
        "",
        "| phase | requests | failed | mean total | p95 total | on the new node |",
        "|---|---|---|---|---|---|",
    ]
    for phase, row in join["phases"].items():
        lines.append(
            f"| sent {phase} it joined | {row['requests']} | {row['failed']} "
            f"| {row['mean_s']:.2f} s | {row['p95_s']:.2f} s | {row['on_new_node']} |"
        )
    lines += [
        "",
        (
            f"Unanswered when it joined: {join['open_at_join']}, of which the new "
            f"node served {join['open_at_join_on_new_node']}."
        ),
        "",
    ]
    sizes = results["sizes"]
    lines += [
        (
            f"Mixed sizes: {sizes['requests']} prompts of 50-8,000 tokens at "
            f"{SIZE_LOAD:.0%} of {SIZE_BACKENDS} x {SIZE_SLOTS} slots "
            f"({SIZE_LATENCY_MS} ms + {SIZE_PREFILL_MS} ms per 1k tokens)"
        ),
        "",
        "| stock in | prompt tokens | served | failed | p50 / p95 total | p50 / p95 wait |",
        "|---|---|---|---|---|---|",
    ]
    for unit, classes in sizes["runs"].items():
        for size, row in classes.items():
            failed = ", ".join(f"{n} x {code}" for code, n in row["failed"].items())
            lines.append(
                f"| {unit} | {size} | {row['served']} | {failed or 0} "
                f"| {row['p50_s'] * 1000:.0f} / {row['p95_s'] * 1000:.0f} ms "
                f"| {row['wait_p50_s'] * 1000:.0f} / {row['wait_p95_s'] * 1000:.0f} ms |"
            )
    return "\n".join(lines)
