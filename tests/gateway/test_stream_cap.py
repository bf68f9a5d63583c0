"""The per-process cap on a key's open streams, and memory given back (units)."""

from __future__ import annotations

import pytest

from gateway.metrics import GatewayMetrics
from gateway.proxy.errors import ProxyError
from gateway.proxy.limits import StreamCap
from nexus_site.servers.unsent import MemoryRelease, release_free_memory


def test_a_key_over_its_streams_is_refused_and_others_are_not() -> None:
    cap, metrics = StreamCap(2), GatewayMetrics()
    cap.take("nx-a", metrics)
    cap.take("nx-a", metrics)
    with pytest.raises(ProxyError) as refused:
        cap.take("nx-a", metrics)
    assert refused.value.status == 429
    assert refused.value.code == "stream_limit_exceeded"
    cap.take("nx-b", metrics)  # another key has its own count
    cap.give_back("nx-a")
    cap.take("nx-a", metrics)  # a stream that ended gave its place back


def test_counts_of_keys_without_streams_are_forgotten() -> None:
    cap, metrics = StreamCap(2), GatewayMetrics()
    cap.take("nx-a", metrics)
    cap.give_back("nx-a")
    assert cap.open == {}


def test_a_cap_of_0_is_no_cap() -> None:
    cap, metrics = StreamCap(0), GatewayMetrics()
    for _ in range(1000):
        cap.take("nx-a", metrics)


def test_memory_is_released_once_for_a_burst_of_requests() -> None:
    scheduled: list[tuple[float, object]] = []
    release = MemoryRelease(lambda delay, call: scheduled.append((delay, call)))
    for _ in range(3):
        release.soon()
    if not release_free_memory():
        assert scheduled == []  # no glibc: nothing to do
        return
    assert len(scheduled) == 1
    delay, call = scheduled.pop()
    assert delay == 1.0
    call()  # type: ignore[operator]
    release.soon()  # and again after it ran
    assert len(scheduled) == 1
