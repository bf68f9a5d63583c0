"""The circuit breaker: opening on proxy-seen failures, in this and other processes."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from backends.health import check_all, record_breaker_opening
from backends.models import Backend, HealthStatus
from backends.tasks import persist_breaker_opening
from gateway.breaker import BREAKER_GROUP, BreakerSettings, CircuitBreaker
from nexus_lib.groups import listen_to_group
from routing.core import (
    BackendSpec,
    LiveStats,
    ModelSpec,
    NoHealthyBackend,
    Reason,
    RequestRequirements,
    Router,
    RouterSnapshot,
)
from routing.versioning import read_config_version
from tests.backends.mock_fleet import running_mocks
from tests.conftest import NexusServer
from tests.factories import BackendFactory, BackendModelFactory

RULES = BreakerSettings(failures=3, window=10.0, cooldown=30.0, persist=False)


class Clock:
    """A hand-driven monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_breaker(
    clock: Clock | None = None, rules: BreakerSettings = RULES
) -> tuple[CircuitBreaker, LiveStats]:
    stats = LiveStats(clock=clock or Clock())
    return CircuitBreaker(stats=stats, config=rules), stats


def test_k_failures_within_the_window_open_the_circuit() -> None:
    breaker, stats = make_breaker()
    breaker.record_failure("gpu-1")
    breaker.record_failure("gpu-1")
    assert not breaker.is_open("gpu-1")
    breaker.record_failure("gpu-1")
    assert breaker.is_open("gpu-1")
    assert not breaker.is_open("gpu-2")
    assert stats.is_circuit_open("gpu-1")


def test_failures_spread_wider_than_the_window_do_not_open_it() -> None:
    clock = Clock()
    breaker, _ = make_breaker(clock)
    for _ in range(5):
        breaker.record_failure("gpu-1")
        clock.now += 6.0
    assert not breaker.is_open("gpu-1")


def test_a_success_forgets_earlier_failures() -> None:
    breaker, _ = make_breaker()
    breaker.record_failure("gpu-1")
    breaker.record_failure("gpu-1")
    breaker.record_success("gpu-1")
    breaker.record_failure("gpu-1")
    breaker.record_failure("gpu-1")
    assert not breaker.is_open("gpu-1")


def test_the_circuit_closes_after_the_cool_down_then_one_failure_reopens_it() -> None:
    clock = Clock()
    breaker, _ = make_breaker(clock)
    for _ in range(3):
        breaker.record_failure("gpu-1")
    clock.now += 29.9
    assert breaker.is_open("gpu-1")
    clock.now += 0.2
    assert not breaker.is_open("gpu-1")
    breaker.record_failure("gpu-1")
    assert breaker.is_open("gpu-1")
    clock.now += 31
    breaker.record_success("gpu-1")
    breaker.record_failure("gpu-1")
    assert not breaker.is_open("gpu-1")


def test_one_keys_failures_do_not_open_a_circuit_that_serves_other_keys() -> None:
    clock = Clock()
    breaker, _ = make_breaker(clock)
    breaker.record_success("gpu-1", "victim")
    clock.now += 9
    for _ in range(10):
        breaker.record_failure("gpu-1", "attacker")
    assert not breaker.is_open("gpu-1")
    clock.now += 1.1  # the victim's success is out of the window now
    breaker.record_failure("gpu-1", "attacker")
    assert breaker.is_open("gpu-1")  # as far as this process knows, one tenant


def test_failures_of_two_keys_open_it_whoever_was_served() -> None:
    breaker, _ = make_breaker()
    breaker.record_success("gpu-1", "c")
    breaker.record_failure("gpu-1", "a")
    breaker.record_failure("gpu-1", "a")
    breaker.record_failure("gpu-1", "b")
    assert breaker.is_open("gpu-1")


def test_a_5xx_the_next_backend_repeats_opens_it_only_with_another_keys() -> None:
    breaker, _ = make_breaker()
    for _ in range(10):
        breaker.record_failure("gpu-1", "a", suspect=True)
    assert not breaker.is_open("gpu-1")
    breaker.record_failure("gpu-1", "b")
    assert breaker.is_open("gpu-1")


def test_a_one_key_opening_is_not_persisted_and_declined_where_others_are_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queued: list[tuple[str, ...]] = []
    monkeypatch.setattr(persist_breaker_opening, "delay", lambda *a: queued.append(a))
    events: list[Any] = []
    rules = BreakerSettings(failures=2, persist=True)
    here, _ = make_breaker(rules=rules)
    here._announce = events.append  # type: ignore[method-assign]
    here.record_failure("gpu-1", "attacker")
    here.record_failure("gpu-1", "attacker")
    assert here.is_open("gpu-1")
    assert events[0]["key"] == "attacker"
    asyncio.run(here._publish(events[0]))
    assert queued == []  # the database's mark would pause it for every key

    elsewhere, _ = make_breaker(rules=rules)
    elsewhere.record_success("gpu-1", "victim")
    elsewhere.on_message(events[0])
    assert not elsewhere.is_open("gpu-1")
    quiet, _ = make_breaker(rules=rules)
    quiet.on_message(events[0])
    assert quiet.is_open("gpu-1")


def snapshot() -> RouterSnapshot:
    model = ModelSpec(name="llama3:8b")
    return RouterSnapshot.build(
        backends=[
            BackendSpec(
                name=name,
                base_url=f"http://{name}:8000",
                priority=priority,
                status="healthy",
                models=(model,),
            )
            for name, priority in (("gpu-1", 1), ("gpu-2", 2))
        ]
    )


def test_the_router_skips_a_backend_whose_circuit_is_open() -> None:
    breaker, stats = make_breaker()
    request = RequestRequirements(model="llama3:8b")
    assert Router().select(request, snapshot(), stats).target.backend_name == "gpu-1"
    for _ in range(3):
        breaker.record_failure("gpu-1")
    route = Router().select(request, snapshot(), stats)
    assert route.target.backend_name == "gpu-2"
    assert route.retry_targets == ()
    (excluded,) = route.decision.excluded
    assert excluded.reasons == (Reason.CIRCUIT_OPEN,)
    assert "circuit breaker open" in excluded.detail


def test_with_every_circuit_open_the_client_gets_a_503_saying_why() -> None:
    breaker, stats = make_breaker()
    for name in ("gpu-1", "gpu-2"):
        for _ in range(3):
            breaker.record_failure(name)
    with pytest.raises(NoHealthyBackend) as caught:
        Router().select(RequestRequirements(model="llama3:8b"), snapshot(), stats)
    assert caught.value.status == 503
    assert "2 with an open circuit breaker" in str(caught.value)


async def test_an_opening_reaches_breakers_listening_on_the_channel_layer() -> None:
    here, _ = make_breaker()
    there, _ = make_breaker()
    # Each serving process's gateway listens for its breaker.
    listeners = [
        asyncio.create_task(listen_to_group(BREAKER_GROUP, breaker.on_message))
        for breaker in (here, there)
    ]
    try:
        await asyncio.sleep(0.1)  # let the listeners join the group
        for _ in range(3):
            here.record_failure("gpu-1")
        await here.drain()
        deadline = time.monotonic() + 5
        while not there.is_open("gpu-1"):
            assert time.monotonic() < deadline, "the opening never arrived"
            await asyncio.sleep(0.02)
        assert here.is_open("gpu-1")
        # The receiver does not count it as its own failures, nor announce it.
        assert there._background == set()
        assert not there.is_open("gpu-2")
    finally:
        for listener in listeners:
            listener.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)
        await here.stop()
        await there.stop()


@pytest.mark.django_db(transaction=True)
def test_a_persisted_opening_marks_the_backend_unhealthy_until_probes_pass(
    settings: Any,
) -> None:
    settings.NEXUS_HEALTH_RECOVERY_THRESHOLD = 2
    with running_mocks(("openai", "--models", "m")) as (mock,):
        backend = mock.register("gpu-1", status=HealthStatus.HEALTHY)
        draining = BackendFactory(name="gpu-2", status=HealthStatus.DRAINING)
        before = read_config_version()
        assert record_breaker_opening("gpu-1", "5 failures within 10 s")
        assert not record_breaker_opening("gpu-2", "5 failures within 10 s")
        assert not record_breaker_opening("no-such-backend", "whatever")
        backend.refresh_from_db()
        assert backend.status == HealthStatus.UNHEALTHY
        assert backend.last_error == "circuit breaker opened: 5 failures within 10 s"
        assert read_config_version() == before + 1
        draining.refresh_from_db()
        assert draining.status == HealthStatus.DRAINING
        check_all()
        backend.refresh_from_db()
        assert backend.status == HealthStatus.UNHEALTHY
        check_all()
        backend.refresh_from_db()
        assert backend.status == HealthStatus.HEALTHY


async def test_an_opening_queues_the_persisting_task_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queued: list[tuple[tuple[str, ...], bool]] = []

    def delay(*args: str) -> None:
        on_loop = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            on_loop = False
        queued.append((args, on_loop))

    monkeypatch.setattr(persist_breaker_opening, "delay", delay)
    breaker, _ = make_breaker(rules=BreakerSettings(failures=2, persist=True))
    breaker.record_failure("gpu-1", "key-a")
    breaker.record_failure("gpu-1", "key-b")
    assert breaker.is_open("gpu-1")
    await breaker.drain()
    # Queueing talks to the broker: it happens in a worker thread, never on the
    # event loop that serves requests.
    assert queued == [(("gpu-1", "2 failures within 10 s seen by the gateway"), False)]


@pytest.mark.skipif(
    os.environ.get("NEXUS_TEST_MODE", "embedded") != "production",
    reason="the embedded in-memory channel layer reaches no other process",
)
@pytest.mark.django_db(transaction=True)
def test_an_opening_in_one_process_stops_routing_in_a_serving_process(
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    for name in ("gpu-1", "gpu-2"):
        backend = BackendFactory(name=name, status=HealthStatus.HEALTHY)
        BackendModelFactory(backend=backend, name="llama3:8b")
    staff = get_user_model().objects.create_user(
        "ops", is_staff=True, is_superuser=True
    )
    token = Token.objects.create(user=staff).key
    server = nexus_server_factory()

    def excluded() -> dict[str, list[str]]:
        response = httpx.post(
            f"{server.base_url}/api/v1/route/explain",
            json={"model": "llama3:8b"},
            headers={"Authorization": f"Token {token}"},
            timeout=5,
        )
        return {e["backend"]: e["reasons"] for e in response.json()["excluded"]}

    assert excluded() == {}  # also starts the server's background tasks
    time.sleep(0.5)  # for its listener to join the group

    async def open_here() -> None:
        # This test process plays the part of another serving process's proxy.
        breaker, _ = make_breaker()
        for _ in range(3):
            breaker.record_failure("gpu-1")
        await breaker.drain()

    asyncio.run(open_here())
    deadline = time.monotonic() + 5
    while (seen := excluded()) != {"gpu-1": ["circuit_open"]}:
        assert time.monotonic() < deadline, (
            f"the serving process never opened the circuit (excluded: {seen}); "
            "does the gateway listen to the breaker group?"
        )
        time.sleep(0.1)
    # Nothing was written: the opening travelled on the channel layer alone.
    assert Backend.objects.get(name="gpu-1").status == HealthStatus.HEALTHY
