"""The prefix benchmark: cache-aware routing on a fleet with prompt caches.

``make bench BENCH_ARGS=--prefix``. Three OpenAI-compatible mock nodes, 4
slots each, with a prompt cache (nexus_mock.prefix_cache) that holds about a
third of the tenants' prompts, and a prompt block not in it costs
``BLOCK_MS``. Twelve tenants, each with a long system prompt (~24,000
characters, ~6,000 tokens), send a Zipf-like mix (tenant k's share ~ 1/k) of
240 requests, 12 at a time, each with a question of its own; requests wait in
the nodes' own queues (no max_concurrency, admission control off). Compared:
smart and fleet, with and without ``[routing.prefix]``, a workload whose
prompts share nothing (a system prompt per request), two serving processes,
and the load guard's sensitivity (--prefix-guards).
The report gives the client-side mean and p90, the block hit rate the nodes
counted, and the largest node's share of the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from django.db import transaction

from backends.models import Backend, BackendModel, HealthStatus
from routing.core.prefix_policy import PrefixPolicy
from routing.models import RoutingPolicy
from tests.bench.processes import TargetSpec, start_daphne, start_target
from usage.models import ApiKey

NODES = ("prefix-a", "prefix-b", "prefix-c")
MODEL = "bench-prefix"
SLOTS = 4
TENANTS = 12
SYSTEM_CHARS = 24_000  # ~6,000 tokens, as in issue 31
QUESTION_CHARS = 200
BLOCK_CHARS = 256
# A tenant's prompt is ~96 blocks: a node holds 4 tenants' prompts and a
# little room for the questions' own blocks.
CACHE_BLOCKS = 400
BLOCK_MS = 2.0
LATENCY_MS = 20.0
CONCURRENCY = 12
KEY_NAME = "bench-prefix"
# (label, strategy, prefix on, max_imbalance, workload, serving processes);
# the guard is the policy's default (PrefixPolicy.max_imbalance).
GUARD = PrefixPolicy().max_imbalance
RUNS = (
    ("smart", "smart", False, GUARD, "shared", 1),
    ("smart + prefix", "smart", True, GUARD, "shared", 1),
    ("fleet", "fleet", False, GUARD, "shared", 1),
    ("fleet + prefix", "fleet", True, GUARD, "shared", 1),
    ("smart, nothing shared", "smart", False, GUARD, "unique", 1),
    ("smart + prefix, nothing shared", "smart", True, GUARD, "unique", 1),
    # Each serving process has an index of its own (gateway/prefix.py).
    ("smart + prefix, 2 processes", "smart", True, GUARD, "shared", 2),
)


def _words(rng: random.Random, chars: int) -> str:
    text: list[str] = []
    size = 0
    while size < chars:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))
        text.append(word)
        size += 7
    return " ".join(text)[:chars]


def build_workload(count: int, shared: bool, seed: int = 31) -> list[list[dict]]:
    """Each request's messages: a tenant's system prompt (Zipf-like mix) and
    a question of its own; with ``shared`` False, a system prompt of its own."""
    rng = random.Random(seed)
    systems = [
        f"You are the assistant of tenant {t}. " + _words(rng, SYSTEM_CHARS)
        for t in range(TENANTS)
    ]
    weights = [1 / (k + 1) for k in range(TENANTS)]
    plan = []
    for n in range(count):
        tenant = rng.choices(range(TENANTS), weights)[0]
        system = (
            systems[tenant] if shared else f"Request {n}. " + _words(rng, SYSTEM_CHARS)
        )
        plan.append(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": _words(rng, QUESTION_CHARS)},
            ]
        )
    return plan


@contextlib.contextmanager
def _rows(urls: list[str]) -> Iterator[str]:
    with transaction.atomic():
        Backend.objects.filter(name__in=NODES).delete()
        ApiKey.objects.filter(name=KEY_NAME).delete()
        for name, url in zip(NODES, urls, strict=True):
            backend = Backend.objects.create(
                name=name,
                base_url=url,
                status=HealthStatus.HEALTHY,
            )
            BackendModel.objects.create(backend=backend, name=MODEL)
        _, key = ApiKey.objects.create_key(KEY_NAME)
    stored = RoutingPolicy.load()
    saved = (
        stored.strategy,
        stored.prefix_enabled,
        stored.prefix_max_imbalance,
        stored.admission_enabled,
    )
    try:
        yield key
    finally:
        policy = RoutingPolicy.load()
        (
            policy.strategy,
            policy.prefix_enabled,
            policy.prefix_max_imbalance,
            policy.admission_enabled,
        ) = saved
        policy.save()
        Backend.objects.filter(name__in=NODES).delete()
        ApiKey.objects.filter(name=KEY_NAME).delete()


def _set_policy(strategy: str, prefix: bool, imbalance: int) -> None:
    policy = RoutingPolicy.load()
    policy.strategy = strategy
    policy.prefix_enabled = prefix
    policy.prefix_max_imbalance = imbalance
    policy.prefix_cache_blocks = CACHE_BLOCKS
    # Requests wait in the nodes' own queues (their slots), as at a model
    # server without a max_concurrency set: routing alone is compared.
    policy.admission_enabled = False
    policy.fleet_queue_timeout_seconds = 300.0
    policy.fleet_queue_length = 1000
    policy.full_clean()
    policy.save()


async def _run(base_url: str, key: str, plan: list[list[dict]]) -> dict[str, Any]:
    timings: list[float] = []
    failures: dict[str, int] = {}
    served: dict[str, int] = {}
    reasons: dict[str, int] = {}
    detail: list[tuple[str, str, str, float]] = []
    queue = list(enumerate(plan))
    queue.reverse()

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            _, messages = queue.pop()
            started = time.perf_counter()
            try:
                reply = await client.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 8},
                    headers={"authorization": f"Bearer {key}"},
                )
            except httpx.HTTPError as error:
                name = type(error).__name__
                failures[name] = failures.get(name, 0) + 1
                continue
            if reply.status_code != 200:
                code = str(reply.status_code)
                failures[code] = failures.get(code, 0) + 1
                continue
            seconds = time.perf_counter() - started
            timings.append(seconds)
            backend = reply.headers.get("x-nexus-backend", "")
            served[backend] = served.get(backend, 0) + 1
            reason = reply.headers.get("x-nexus-route-reason", "").split(";")[0]
            reasons[reason or "-"] = reasons.get(reason or "-", 0) + 1
            rid = reply.headers["x-request-id"]
            detail.append((reason or "-", backend, rid, round(seconds, 4)))

    limits = httpx.Limits(max_connections=CONCURRENCY + 4)
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=300.0, trust_env=False
    ) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
    return {
        "timings": timings,
        "failures": failures,
        "served": served,
        "reasons": reasons,
        "detail": detail,
    }


def _node_args(name: str) -> list[str]:
    return [
        "--name", name, "--models", MODEL, "--slots", str(SLOTS),
        "--latency-ms", f"{LATENCY_MS:g}",
        "--prefix-block-chars", str(BLOCK_CHARS),
        "--prefix-cache-blocks", str(CACHE_BLOCKS),
        "--prefix-block-ms", f"{BLOCK_MS:g}",
        "--record-requests", "0",
    ]  # fmt: skip


def run_prefix_benchmark(
    env: dict[str, str],
    spawn_mock: Callable[..., Any],
    logs: Path,
    requests: int,
    progress: Callable[[str], None],
    guards: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Run every configuration of RUNS, then smart + prefix with each of
    `guards` (max_imbalance), on fresh nodes; return their numbers."""
    plans = {
        "shared": build_workload(requests, shared=True),
        "unique": build_workload(requests, shared=False),
    }
    results: dict[str, Any] = {"requests": requests, "runs": {}}
    runs = [
        *RUNS,
        *(
            (f"smart + prefix, guard {g}", "smart", True, g, "shared", 1)
            for g in guards
        ),
    ]
    for label, strategy, prefix, imbalance, workload, processes in runs:
        progress(f"prefix: {requests} requests, {label}")
        mocks = [spawn_mock(*_node_args(name), env=env) for name in NODES]
        try:
            with _rows([m.base_url for m in mocks]) as key:
                _set_policy(strategy, prefix, imbalance)
                server = (
                    start_daphne(env, logs)
                    if processes == 1
                    else start_target(
                        TargetSpec(f"daphne-x{processes}", "daphne", processes),
                        env,
                        Path.cwd(),
                        logs,
                        (),
                        ("/health/ready", {}),
                    )
                )
                try:
                    outcome = asyncio.run(_run(server.url, key, plans[workload]))
                finally:
                    server.stop()
                nodes = {
                    name: httpx.get(f"{m.base_url}/_mock/stats").json()
                    for name, m in zip(NODES, mocks, strict=True)
                }
        finally:
            for mock in mocks:
                mock.stop()
        found: dict[str, list[int]] = {}
        for node in nodes.values():
            found.update(node.pop("prefix_requests"))
        timings = outcome["timings"]
        hits = sum(node["prefix_cache_hits"] for node in nodes.values())
        queries = sum(node["prefix_cache_queries"] for node in nodes.values())
        served = outcome["served"]
        results["runs"][label] = {
            "workload": workload,
            "served": len(timings),
            "failures": outcome["failures"],
            "mean_s": sum(timings) / len(timings) if timings else float("nan"),
            "p90_s": _pct(timings, 90),
            "hit_rate": hits / queries if queries else 0.0,
            "largest_share": max(served.values()) / len(timings) if timings else 0,
            "served_by": served,
            "reasons": outcome["reasons"],
            # Per request in answer order: signal, backend, seconds, blocks
            # found in the cache, blocks.
            "detail": [
                (reason, backend, seconds, *found.get(rid, (0, 0)))
                for reason, backend, rid, seconds in outcome["detail"]
            ],
        }
    return results


def _pct(samples: list[float], pct: int) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def format_prefix_report(results: dict[str, Any]) -> str:
    runs = results["runs"]
    lines = [
        (
            f"{results['requests']} requests at concurrency {CONCURRENCY}, "
            f"{TENANTS} tenants (~{SYSTEM_CHARS} character system prompts, "
            f"Zipf-like mix); 3 mock nodes, {SLOTS} slots, prompt caches of "
            f"{CACHE_BLOCKS} blocks of {BLOCK_CHARS} characters (~a third of the "
            f"tenants each), {BLOCK_MS:g} ms per block computed"
        ),
        "",
        "| run | served | mean | p90 | block hit rate | largest node share |",
        "|---|---|---|---|---|---|",
    ]
    for label, run in runs.items():
        failed = sum(run["failures"].values())
        lines.append(
            f"| {label} | {run['served']}{f' ({failed} failed)' if failed else ''}"
            f" | {run['mean_s'] * 1000:.0f} ms | {run['p90_s'] * 1000:.0f} ms"
            f" | {run['hit_rate']:.2f} | {run['largest_share']:.0%} |"
        )
    blind = runs.get("smart")
    if blind is not None:
        lines.append("")
        for label in ("smart + prefix", "fleet + prefix"):
            run = runs.get(label)
            if run is None:
                continue
            mean = run["mean_s"] / blind["mean_s"]
            p90 = run["p90_s"] / blind["p90_s"]
            ok = (
                mean <= 0.3
                and p90 <= 0.4
                and run["hit_rate"] >= 0.9
                and run["largest_share"] <= 0.5
            )
            lines.append(
                f"Goal ({label} vs cache-blind smart): mean {mean:.2f}x (<= 0.3), "
                f"p90 {p90:.2f}x (<= 0.4), hit rate {run['hit_rate']:.2f} "
                f"(>= 0.9), largest share {run['largest_share']:.0%} (<= 50 %): "
                f"{'PASS' if ok else 'MISS'}"
            )
    plain = runs.get("smart, nothing shared")
    aware = runs.get("smart + prefix, nothing shared")
    if plain is not None and aware is not None:
        ratio = aware["mean_s"] / plain["mean_s"]
        lines.append(
            f"Goal (nothing shared): prefix routing's mean {ratio:.2f}x of "
            f"cache-blind (within noise, <= 1.05): "
            f"{'PASS' if ratio <= 1.05 else 'MISS'}"
        )
    return "\n".join(lines)
