"""Admission control's benchmark: two tenants on a small fleet, and the bypass cost.

``make bench BENCH_ARGS=--admission``. Two mock backends with 4 slots each
and 200 ms per request (40 requests/s in all). Tenant A keeps 80 requests
outstanding (10x the slots, a closed loop: a new one as each ends); tenant B
sends one request a second. Measured with admission control off, on, and on
with the backends' max_concurrency set to their slots: B's latency alone
(unloaded) and beside A, and what each tenant got through. Then
the cost of the bypass path itself (prepare, admit, release on an idle pool),
timed in-process over many calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from django.db import transaction

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import RoutingPolicy
from tests.bench.processes import start_daphne
from usage.models import ApiKey

MODEL = "nexus-bench-admission"
SLOTS = 4
LATENCY_MS = 200
FLOOD_OUTSTANDING = 80
LIGHT_RATE = 1.0  # requests a second
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


@contextlib.contextmanager
def _rows(urls: list[str]) -> Iterator[tuple[str, str]]:
    names = [f"bench-admission-{i}" for i in range(len(urls))]
    with transaction.atomic():
        Backend.objects.filter(name__in=names).delete()
        ApiKey.objects.filter(name__in=("bench-tenant-a", "bench-tenant-b")).delete()
        for name, url in zip(names, urls, strict=True):
            backend = Backend.objects.create(
                name=name, base_url=url, status=HealthStatus.HEALTHY
            )
            BackendModel.objects.create(backend=backend, name=MODEL)
        _, key_a = ApiKey.objects.create_key("bench-tenant-a")
        _, key_b = ApiKey.objects.create_key("bench-tenant-b")
    policy = RoutingPolicy.load()
    saved = {f: getattr(policy, f) for f in ("admission_enabled",)}
    try:
        yield key_a, key_b
    finally:
        for field, value in saved.items():
            setattr(policy, field, value)
        policy.save()
        Backend.objects.filter(name__in=names).delete()
        ApiKey.objects.filter(name__in=("bench-tenant-a", "bench-tenant-b")).delete()


# (label, admission on, the backends' max_concurrency). The last row is how an
# operator who knows the slots configures them: the band is then exactly the
# slots, and the router never sends a request to a backend whose slots are
# all busy while another has one free.
RUNS: tuple[tuple[str, bool, int | None], ...] = (
    ("off", False, None),
    ("on", True, None),
    (f"on, max_concurrency {SLOTS}", True, SLOTS),
)


def _set_admission(enabled: bool, max_concurrency: int | None = None) -> None:
    Backend.objects.filter(name__startswith="bench-admission-").update(
        max_concurrency=max_concurrency
    )
    policy = RoutingPolicy.load()
    policy.admission_enabled = enabled
    # A band that matches the slots: lower 3.6, upper 4.4 per backend.
    policy.admission_watermark_per_backend = float(SLOTS)
    policy.admission_percentage_deviation_for_bounds = 0.1
    policy.admission_flow_key = "key"
    policy.full_clean()
    policy.save()


async def _light(
    client: httpx.AsyncClient, key: str, seconds: float
) -> tuple[list[float], int]:
    end = time.monotonic() + seconds
    return await paced_requests(
        client, key, BODY, LIGHT_RATE, lambda: time.monotonic() >= end
    )


async def paced_requests(
    client: httpx.AsyncClient,
    key: str,
    body: dict[str, Any],
    rate: float,
    until: Callable[[], bool],
) -> tuple[list[float], int]:
    """Send `rate` chat requests a second (open loop) until `until()`; return
    the latencies of those answered 200 and how many failed."""
    latencies: list[float] = []
    failures = 0

    async def one() -> None:
        nonlocal failures
        started = time.perf_counter()
        reply = await client.post(
            "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
        )
        if reply.status_code == 200:
            latencies.append(time.perf_counter() - started)
        else:
            failures += 1

    tasks = []
    while not until():
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(1 / rate)
    await asyncio.gather(*tasks)
    return latencies, failures


async def _flood(
    client: httpx.AsyncClient, key: str, stop: asyncio.Event
) -> tuple[int, int]:
    served = refused = 0

    async def worker() -> None:
        nonlocal served, refused
        while not stop.is_set():
            reply = await client.post(
                "/v1/chat/completions",
                json=BODY,
                headers={"authorization": f"Bearer {key}"},
            )
            if reply.status_code == 200:
                served += 1
            else:
                refused += 1
                await asyncio.sleep(0.05)

    await asyncio.gather(*(worker() for _ in range(FLOOD_OUTSTANDING)))
    return served, refused


async def _scenario(base_url: str, key_a: str, key_b: str, seconds: float) -> dict:
    limits = httpx.Limits(max_connections=FLOOD_OUTSTANDING + 20)
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=timeout, trust_env=False
    ) as client:
        alone, _ = await _light(client, key_b, seconds / 2)
        stop = asyncio.Event()
        flood = asyncio.create_task(_flood(client, key_a, stop))
        await asyncio.sleep(2)  # let the pile build up
        started = time.monotonic()
        beside, b_failed = await _light(client, key_b, seconds)
        elapsed = time.monotonic() - started
        stop.set()
        a_served, a_refused = await flood
    return {
        "b_unloaded_p50_ms": _pct(alone, 50),
        "b_unloaded_p99_ms": _pct(alone, 99),
        "b_p50_ms": _pct(beside, 50),
        "b_p99_ms": _pct(beside, 99),
        "b_samples": len(beside),
        "b_failed": b_failed,
        "b_rps": len(beside) / elapsed,
        "a_rps": a_served / (elapsed + 2),
        "a_refused": a_refused,
    }


def _pct(samples: list[float], pct: int) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    index = min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))
    return ordered[index] * 1000


def measure_bypass_cost(calls: int = 200_000) -> dict[str, float]:
    """Microseconds per request the bypass path adds (prepare + admit + release)."""
    from gateway.admission import AdmissionGate
    from routing.core import BackendSpec, ModelSpec, RequestRequirements, RouterSnapshot
    from routing.state import GatewayState

    snapshot = RouterSnapshot.build(
        backends=[
            BackendSpec(
                name="b",
                base_url="http://x",
                status="healthy",
                models=(ModelSpec("m"),),
            )
        ]
    )
    state = GatewayState(version=1, routes=snapshot, keys={})
    requirements = RequestRequirements(model="m", estimated_tokens=10)
    payload = {"model": "m", "max_tokens": 16}
    headers = [(b"content-type", b"application/json"), (b"x-stainless-timeout", b"600")]

    async def run() -> float:
        gate = AdmissionGate()
        started = time.perf_counter()
        for _ in range(calls):
            ticket = gate.prepare(state, requirements, payload, "nx-abc", headers)
            assert ticket is not None
            await gate.admit(ticket)
            gate.release(ticket)
        return (time.perf_counter() - started) / calls * 1e6

    rounds = [asyncio.run(run()) for _ in range(5)]
    return {"bypass_us_median": statistics.median(rounds), "bypass_us_min": min(rounds)}


def run_admission_benchmark(
    env: dict[str, str],
    spawn_mock: Callable[..., Any],
    logs: Path,
    seconds: float,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Run the two-tenant scenario with admission off and on, and the bypass cost."""
    mocks = [
        spawn_mock(
            "--models",
            MODEL,
            "--name",
            f"slots-{i}",
            "--slots",
            str(SLOTS),
            "--latency-ms",
            str(LATENCY_MS),
            env=env,
        )
        for i in range(2)
    ]
    results: dict[str, Any] = {}
    try:
        with _rows([m.base_url for m in mocks]) as (key_a, key_b):
            for label, enabled, max_concurrency in RUNS:
                _set_admission(enabled, max_concurrency)
                progress(f"admission {label}: tenant B alone, then beside A's flood")
                server = start_daphne(env, logs)
                try:
                    results[label] = asyncio.run(
                        _scenario(server.url, key_a, key_b, seconds)
                    )
                finally:
                    server.stop()
    finally:
        for mock in mocks:
            mock.stop()
    progress("bypass cost, in-process")
    results["bypass"] = measure_bypass_cost()
    return results


def format_admission_report(results: dict[str, Any]) -> str:
    lines = [
        (
            f"Two tenants, 2 mock backends x {SLOTS} slots, {LATENCY_MS} ms each "
            f"(40 req/s); A keeps {FLOOD_OUTSTANDING} outstanding, B sends "
            f"{LIGHT_RATE:g}/s"
        ),
        "",
        (
            "| admission | B alone p50 / p99 | B beside A p50 / p99 | B req/s | "
            "A req/s | A refused |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for label, _, _ in RUNS:
        r = results[label]
        lines.append(
            f"| {label} | {r['b_unloaded_p50_ms']:.0f} / {r['b_unloaded_p99_ms']:.0f} ms"
            f" | {r['b_p50_ms']:.0f} / {r['b_p99_ms']:.0f} ms ({r['b_samples']} samples)"
            f" | {r['b_rps']:.2f} | {r['a_rps']:.1f} | {r['a_refused']} |"
        )
    lines.append("")
    for label, enabled, _ in RUNS:
        if not enabled:
            continue
        r = results[label]
        ratio = r["b_p99_ms"] / r["b_unloaded_p99_ms"]
        verdict = "PASS" if ratio <= 2 else "MISS"
        lines.append(
            f"Goal ({label}): B's p99 beside A <= 2x its unloaded p99: "
            f"{ratio:.2f}x ({verdict})"
        )
    bypass = results["bypass"]
    lines.append(
        f"Bypass path (prepare + admit + release, idle pool): "
        f"{bypass['bypass_us_median']:.1f} us per request (median of 5 rounds; "
        f"goal <= 20 us: {'PASS' if bypass['bypass_us_median'] <= 20 else 'MISS'})"
    )
    return "\n".join(lines)
