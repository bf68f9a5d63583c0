"""The relay's per-worker rates and throttles (gateway/relay/limits.py) and
the coalescing of worker-caused configuration versions (gateway/relay/churn.py).

End to end, with a real gateway and hostile workers: test_relay_churn_e2e.py.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.relay import limits
from gateway.relay.churn import ConfigChurn
from gateway.relay.limits import (
    AuthThrottle,
    CredentialGate,
    FrameMeter,
    LogBudget,
    RelayLimits,
)

MiB = 1024 * 1024


def test_a_worker_within_its_rates_is_never_slowed() -> None:
    meter = FrameMeter(RelayLimits(frames_per_second=100), now=0.0)
    for n in range(1000):
        assert meter.charge(1000, now=n / 100) == 0.0


def test_a_flood_is_slowed_to_the_byte_rate_and_over_too_long() -> None:
    rates = RelayLimits(bytes_per_second=1 * MiB, throttle_seconds=3)
    meter = FrameMeter(rates, now=0.0)
    # The burst: one frame of the largest size always fits.
    assert meter.charge(16 * MiB, now=0.0) == 0.0
    # Then each MiB waits a second for the bucket, which the reader sleeps.
    assert meter.charge(MiB, now=0.0) == pytest.approx(1.0)
    assert meter.charge(MiB, now=1.0) == pytest.approx(1.0)
    assert not meter.is_over_too_long(1.0, 1.0)
    assert meter.charge(MiB, now=2.0) == pytest.approx(1.0)
    assert meter.is_over_too_long(2.0, 1.5)  # over for 3 s on end: cut


def test_a_worker_back_under_its_rate_starts_afresh() -> None:
    meter = FrameMeter(RelayLimits(frames_per_second=10, throttle_seconds=1), 0.0)
    waits = [meter.charge(10, now=0.0) for _ in range(101)]
    assert waits[-1] > 0
    assert meter.charge(10, now=60.0) == 0.0
    assert meter.over_since is None


def test_connects_per_credential_are_a_burst_then_the_rate() -> None:
    gate = CredentialGate(rate_per_minute=6, burst=5)
    assert [gate.admit("a", 0.0) for _ in range(5)] == [0.0] * 5
    assert gate.admit("a", 0.0) == pytest.approx(10.0)
    assert gate.admit("b", 0.0) == 0.0  # another credential's own bucket
    assert gate.admit("a", 10.0) == 0.0


def test_the_credential_table_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_ENTRIES", 100)
    gate = CredentialGate(rate_per_minute=6, burst=5)
    for n in range(1000):
        gate.admit(f"key-{n}", 0.0)
    assert len(gate._buckets) <= 100


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failed_authentications_block_an_address_for_a_doubling_time() -> None:
    clock = Clock()
    throttle = AuthThrottle(failures=5, clock=clock)
    assert [throttle.failed("10.0.0.1") for _ in range(4)] == [0.0] * 4
    assert throttle.failed("10.0.0.1") == 10.0
    assert throttle.blocked_for("10.0.0.1") == 10.0
    assert throttle.blocked_for("10.0.0.2") == 0.0  # another address
    clock.now += 10
    assert throttle.blocked_for("10.0.0.1") == 0.0
    assert [throttle.failed("10.0.0.1") for _ in range(5)][-1] == 20.0
    clock.now += 20 + 5
    assert [throttle.failed("10.0.0.1") for _ in range(5)][-1] == 40.0


def test_failed_authentications_log_a_line_per_address_per_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    throttle = AuthThrottle(failures=5, clock=clock)
    with caplog.at_level(logging.WARNING, logger="gateway.relay.limits"):
        for _ in range(120):  # two minutes of attempts, one a second
            if not throttle.blocked_for("10.0.0.1"):
                throttle.failed("10.0.0.1")
            clock.now += 1
    lines = [r.getMessage() for r in caplog.records]
    # The first failure, the first block, then one a minute with the count.
    assert len(lines) <= 4, lines
    assert "10.0.0.1: 1 since the last line" in lines[0]
    assert "refused without a check for 10 s" in lines[1]
    # A minute later, the count of everything since, refusals without a check
    # included.
    assert int(lines[2].split(": ")[1].split()[0]) >= 50, lines


def test_failed_authentications_from_many_addresses_log_a_bounded_number(
    caplog: pytest.LogCaptureFixture,
) -> None:
    throttle = AuthThrottle(failures=5, clock=Clock())
    with caplog.at_level(logging.WARNING, logger="gateway.relay.limits"):
        for n in range(5000):
            throttle.failed(f"10.0.{n // 256}.{n % 256}")
    assert len(caplog.records) == limits.AUTH_LOG_LINES


def test_a_log_budget_counts_what_it_held_back() -> None:
    budget = LogBudget(lines=2)
    assert [budget.allow(0.0) for _ in range(5)] == [0, 0, None, None, None]
    assert budget.allow(60.0) == 3


def test_configuration_churn_bumps_at_once_then_once_per_interval() -> None:
    bumps: list[int] = []

    async def churn() -> None:
        coalescer = ConfigChurn(0.2, bump=lambda: bumps.append(1))
        await coalescer.changed()
        assert len(bumps) == 1  # the first change: at once
        for _ in range(100):
            await coalescer.changed()
        assert len(bumps) == 1
        await asyncio.sleep(0.4)
        assert len(bumps) == 2  # every other change: one bump at the end

    asyncio.run(churn())
