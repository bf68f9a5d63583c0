"""One lifecycle: a gateway starts its services in order and stops them in reverse."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway import process
from gateway.process import Gateway, GatewayConfig, current_gateway, install_gateway
from nexus_lib.service import Service
from nexus_site.launcher import STOP_GRACE_SECONDS
from usage.limits.limiter import LocalLimiter

# Waits on events that the code under test sets; only a hang reaches it.
PATIENCE = 30.0


class Observed:
    """Wraps a service of the gateway: notes each start, stop and stopped."""

    def __init__(self, service: Service, journal: list[tuple[str, str]]) -> None:
        self.service = service
        self.name = service.name
        self.journal = journal

    def start(self) -> None:
        self.journal.append(("start", self.name))
        self.service.start()

    async def stop(self) -> None:
        self.journal.append(("stop", self.name))
        await self.service.stop()
        self.journal.append(("stopped", self.name))


class Stuck:
    """A service whose stop ignores its cancellation until released."""

    name = "stuck"

    def __init__(self) -> None:
        self.release = asyncio.Event()

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue


def make_gateway(drain_seconds: float = PATIENCE) -> Gateway:
    """A gateway of the mode under test, its state loaded at start-up.

    The version check is not due while a test runs: no thread of the test
    process opens a database connection that outlives it.
    """
    config = dataclasses.replace(
        GatewayConfig.from_settings(),
        drain_seconds=drain_seconds,
        config_poll_interval=PATIENCE,
    )
    gateway = Gateway(config)
    gateway.snapshots.load()
    return gateway


def observe(gateway: Gateway) -> list[tuple[str, str]]:
    journal: list[tuple[str, str]] = []
    gateway.services = [Observed(service, journal) for service in gateway.services]
    return journal


async def start_then_stop(gateway: Gateway) -> float:
    """Start `gateway`, let each service's task take its first step, stop it;
    return how long the stop took."""
    loop = asyncio.get_running_loop()
    gateway.start()
    await asyncio.sleep(0)  # the tasks made by start() run their first steps
    began = loop.time()
    await gateway.stop()
    took = loop.time() - began
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert others == []  # nothing left running
    return took


@pytest.mark.django_db
def test_stop_stops_every_service_it_started_in_reverse_within_the_drain_limit() -> (
    None
):
    gateway = make_gateway()
    journal = observe(gateway)

    took = asyncio.run(start_then_stop(gateway))

    started = [name for what, name in journal if what == "start"]
    assert started == [service.name for service in gateway.services]
    stops = [entry for entry in journal if entry[0] != "start"]
    # One at a time, each stopped before the next is asked to stop.
    assert stops == [
        (what, name) for name in reversed(started) for what in ("stop", "stopped")
    ]
    assert took < gateway.stop_seconds
    assert not gateway.started
    with pytest.raises(RuntimeError):
        _ = gateway.upstream.session  # closed


@pytest.mark.django_db
def test_the_relay_stops_first_and_the_upstream_client_last() -> None:
    gateway = make_gateway()
    journal = observe(gateway)

    asyncio.run(start_then_stop(gateway))

    stopped = [name for what, name in journal if what == "stop"]
    reconcile = ["reconcile"] if isinstance(gateway.limiter, LocalLimiter) else []
    assert stopped == [
        "relay",
        "relay-sweep",
        "relay-seen",
        "relay-states",
        "relay-load-listen",
        "gauges",
        "usage-listen",
        "context-limits-listen",
        "breaker-listen",
        *reconcile,
        "admission",
        "fleet",
        "snapshots",
        "publisher",
        "error-cache",
        "breaker",
        "usage-progress",  # its last reports go to the sink, stopped after
        "shadow-comparisons",  # stores the last shadow comparisons
        gateway.usage_sink.name,  # hands on the usage still held
        "response-cache",  # its last stores, before the connections go
        "limiter",
        "upstream",
    ]


@pytest.mark.django_db
def test_a_stuck_service_does_not_hold_the_stop_beyond_the_drain_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process, "STOP_SECONDS_MIN", 0.0)
    gateway = make_gateway(drain_seconds=2.0)
    journal = observe(gateway)
    stuck = Stuck()
    gateway.services.append(stuck)  # started last: stopped first

    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        gateway.start()
        began = loop.time()
        await gateway.stop()
        took = loop.time() - began
        stuck.release.set()
        return took

    took = asyncio.run(scenario())

    # Every service was still asked to stop, in reverse order.
    asked = [name for what, name in journal if what == "stop"]
    started = [name for what, name in journal if what == "start"]
    assert asked == list(reversed(started))
    # Bounded by the limit (a loaded machine may run the loop a little late).
    assert took < gateway.stop_seconds + 5.0


def test_threads_asking_for_the_gateway_at_once_get_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[object] = []

    def build() -> object:
        threading.Event().wait(0.05)  # widen the window between check and set
        built.append(object())
        return built[-1]

    monkeypatch.setattr(process, "_current", None)
    monkeypatch.setattr(process, "Gateway", build)
    with ThreadPoolExecutor(max_workers=8) as pool:
        gateways = list(pool.map(lambda _: current_gateway(), range(8)))

    assert len(built) == 1
    assert all(gateway is built[0] for gateway in gateways)


def test_a_zero_drain_period_still_gives_the_services_time_to_stop() -> None:
    gateway = Gateway(GatewayConfig(drain_seconds=0))

    assert gateway.stop_seconds == process.STOP_SECONDS_MIN


def test_a_process_refuses_a_second_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "_current", None)
    first = Gateway(GatewayConfig())
    install_gateway(first)
    install_gateway(first)  # the same one again: nothing changes

    with pytest.raises(RuntimeError, match="has a gateway already"):
        install_gateway(Gateway(GatewayConfig()))
    assert current_gateway() is first


def test_a_long_drain_period_leaves_the_stop_inside_the_launchers_grace() -> None:
    gateway = Gateway(GatewayConfig(drain_seconds=300))

    assert gateway.stop_seconds == process.STOP_SECONDS_MAX < STOP_GRACE_SECONDS
