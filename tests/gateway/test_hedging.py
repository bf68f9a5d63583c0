"""When a request is hedged, and after how long (gateway/proxy/hedging.py)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from gateway.proxy.hedging import MIN_SAMPLES, FirstByteTimes, plan_hedge
from gateway.proxy.legs import ProxyExchange
from routing.core import RouterSnapshot
from routing.core.traffic import HedgePolicy
from routing.state import GatewayState
from tests.routing.core_builders import backend, snapshot

pytestmark = pytest.mark.mode_independent

ROUTES: RouterSnapshot = snapshot(backend("a", "m"), backend("b", "n"))
TARGET = ROUTES.targets_for("m")[0]
OTHER = ROUTES.targets_for("n")[0]


def _exchange(
    hedging: dict[str, HedgePolicy],
    *,
    endpoint: str = "chat",
    raw: bytes = b"{}",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> ProxyExchange:
    state = GatewayState(
        version=1, routes=ROUTES, keys={}, hedging=MappingProxyType(hedging)
    )
    return ProxyExchange(
        request_id="r",
        endpoint=endpoint,
        path="/v1/chat/completions",
        state=state,
        raw=raw,
        request_headers=headers or [],
    )


def test_only_hedged_models_inference_and_small_bodies_are_hedged() -> None:
    policy = HedgePolicy("m", after_ms=250, max_body_bytes=100)
    times = FirstByteTimes()
    plan = plan_hedge(_exchange({"m": policy}), TARGET, times)
    assert plan is not None and plan.delay == 0.25
    assert plan_hedge(_exchange({}), TARGET, times) is None
    assert plan_hedge(_exchange({"m": policy}), OTHER, times) is None
    assert plan_hedge(_exchange({"m": policy}, raw=b"x" * 101), TARGET, times) is None
    assert (
        plan_hedge(_exchange({"m": policy}, endpoint="responses"), TARGET, times)
        is None
    )
    sheddable = [(b"x-nexus-criticality", b"Sheddable")]
    assert (
        plan_hedge(_exchange({"m": policy}, headers=sheddable), TARGET, times) is None
    )


def test_after_p95_waits_the_observed_p95_once_known() -> None:
    policy = HedgePolicy("m", after="p95", after_ms=300)
    times = FirstByteTimes(samples=100)
    assert times.delay(policy) == 0.3  # nothing seen yet
    for _ in range(MIN_SAMPLES - 1):
        times.observe("m", 0.01)
    assert times.delay(policy) == 0.3
    for n in range(100):
        times.observe("m", 0.5 if n % 20 == 0 else 0.01 * (n % 10 + 1))
    # 5 of the last 100 are 0.5 s: the p95 is the slowest of the rest.
    assert times.delay(policy) == pytest.approx(0.1)
    # Fixed: the p95 is never used.
    assert times.delay(HedgePolicy("m", after_ms=40)) == 0.04
