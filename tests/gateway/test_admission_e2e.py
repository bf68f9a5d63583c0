"""Admission control end to end: Daphne serving Nexus, mock backends with a few
slots (they queue inside like a model server), the official openai SDK.

Runs in both modes; the two-process test shares the band through the
launcher's environment in the embedded default and through the live process
registry in Redis in production mode.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import Alias, FallbackChain, RoutingPolicy
from tests.conftest import MockBackendProcess, NexusServer, mock_stats, wait_until
from tests.factories import StaffUserFactory
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)

PRODUCTION = os.environ.get("NEXUS_TEST_MODE") == "production"
MESSAGES = [{"role": "user", "content": "hi"}]


def _configure(**admission: Any) -> None:
    policy = RoutingPolicy.load()
    for name, value in admission.items():
        setattr(policy, f"admission_{name}", value)
    policy.full_clean()
    policy.save()


def _backend(
    mock: MockBackendProcess,
    name: str = "slotted",
    model: str = "m",
    max_concurrency: int | None = None,
) -> None:
    backend = Backend.objects.create(
        name=name,
        base_url=mock.base_url,
        status=HealthStatus.HEALTHY,
        max_concurrency=max_concurrency,
    )
    BackendModel.objects.create(backend=backend, name=model)


def _client(server: NexusServer, key: str, timeout: float = 30) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=timeout
    )


@pytest.fixture
def slotted(
    mock_backend_factory: Callable[..., MockBackendProcess],
) -> Iterator[MockBackendProcess]:
    """One backend serving "m" with 2 slots and 300 ms per request."""
    mock = mock_backend_factory(
        "--models", "m", "--name", "slotted", "--slots", "2", "--latency-ms", "300"
    )
    _backend(mock)
    yield mock


def test_a_light_key_is_served_while_a_flooding_key_waits(
    slotted: MockBackendProcess,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    # Band for one backend: lower 1.8, upper 2.2 (at most 3 let through).
    _configure(watermark_per_backend=2.0)
    _, flood_key = ApiKey.objects.create_key("flood")
    _, light_key = ApiKey.objects.create_key("light")
    server = nexus_server_factory()
    # The requests let through wait at the mock until the flood and the light
    # request are all queued, however slowly a loaded machine sends them.
    httpx.post(f"{slotted.base_url}/_mock/hold", json={"first": 100})

    async def scenario() -> tuple[int, int, list[float]]:
        flood_client, light_client = (
            _client(server, flood_key, timeout=60),
            _client(server, light_key, timeout=60),
        )
        flood = [
            asyncio.create_task(
                flood_client.chat.completions.create(model="m", messages=MESSAGES)
            )
            for _ in range(16)
        ]
        # At most 3 let through: 13 or more waiting (none leaves while held).
        waiting = await asyncio.to_thread(
            wait_until,
            lambda: (q := server.metric("nexus_admission_queue_length")) >= 13 and q,
            60,
        )
        started = time.monotonic()
        light = asyncio.create_task(
            light_client.chat.completions.create(model="m", messages=MESSAGES)
        )
        await asyncio.to_thread(
            wait_until,
            lambda: server.metric("nexus_admission_queue_length") > waiting,
            60,
        )
        await asyncio.to_thread(httpx.post, f"{slotted.base_url}/_mock/release")
        await light
        light_latency = time.monotonic() - started
        flood_done_then = sum(task.done() for task in flood)
        replies = await asyncio.gather(*flood)
        return flood_done_then, len(replies), [light_latency]

    flood_done_then, flood_served, _ = asyncio.run(scenario())
    # The light key waited behind the requests in flight and a turn or two,
    # not the flood: served in FIFO order it would come after 13 or more of
    # them. (Half the flood leaves room for a loaded machine's scheduling.)
    assert flood_done_then <= 8
    assert flood_served == 16
    stats = mock_stats(slotted)
    assert stats["peak_outstanding"] <= 3  # the band, not the flood, reached it
    assert stats["requests"]["/v1/chat/completions"] == 17
    # At rest: nothing in flight, nothing waiting.
    wait_until(lambda: server.metric("nexus_admission_stock_level") == 0)
    assert server.metric("nexus_admission_queue_length") == 0
    assert server.metric("nexus_admission_dequeue_successes_total") >= 10


def test_a_client_that_leaves_while_queued_never_reaches_the_backend(
    slotted: MockBackendProcess,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    # One let through, then the queue.
    _configure(lower_bound_per_backend=1.0, upper_bound_per_backend=1.0)
    _, key = ApiKey.objects.create_key("impatient")
    server = nexus_server_factory()
    httpx.post(f"{slotted.base_url}/_mock/config", json={"latency_ms": 1500})

    async def scenario() -> None:
        holder = asyncio.create_task(
            _client(server, key).chat.completions.create(model="m", messages=MESSAGES)
        )
        await asyncio.to_thread(
            wait_until, lambda: mock_stats(slotted)["busy_slots"] == 1
        )
        with pytest.raises(openai.APITimeoutError):
            await _client(server, key, timeout=0.4).chat.completions.create(
                model="m", messages=MESSAGES
            )
        await holder

    asyncio.run(scenario())
    assert mock_stats(slotted)["requests"]["/v1/chat/completions"] == 1
    # Recorded (usage and the access log share the same figures) as 499,
    # with no backend and no tokens.
    line = wait_until(lambda: next((x for x in server.log if "status=499" in x), None))
    assert "backend=- " in line
    assert "tokens_in=0 tokens_out=0" in line
    assert "error=client_closed" in line
    wait_until(lambda: server.metric("nexus_admission_stock_level") == 0)
    assert server.metric("nexus_admission_requests_cancelled_total") == 1


def test_refusals_come_in_openais_shape_with_retry_after(
    slotted: MockBackendProcess,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    _configure(
        watermark_per_backend=1.0,
        flow_capacity=2,
        total_capacity=100,
        critical_reserved=0,
    )
    _, key = ApiKey.objects.create_key("busy")
    server = nexus_server_factory()
    httpx.post(f"{slotted.base_url}/_mock/config", json={"latency_ms": 1000})
    # The two let through wait at the mock until the other four have been
    # queued or refused, however slowly a loaded machine sends them.
    httpx.post(f"{slotted.base_url}/_mock/hold", json={"first": 3})

    async def scenario() -> list[Any]:
        client = _client(server, key)
        calls = [
            asyncio.ensure_future(
                client.chat.completions.with_raw_response.create(
                    model="m", messages=MESSAGES
                )
            )
            for _ in range(6)
        ]
        deadline = time.monotonic() + 30
        while sum(call.done() for call in calls) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(httpx.post, f"{slotted.base_url}/_mock/release")
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(scenario())
    refused = [o for o in outcomes if isinstance(o, openai.APIStatusError)]
    # Two let through (the bypass limit), two waiting (the flow capacity).
    assert len(refused) == 2
    for error in refused:
        assert error.status_code == 503
        assert error.code == "flow_queue_full"
        assert error.body["type"] == "server_error"  # type: ignore[index]
        assert error.response.headers["retry-after"] == "1"

    # A deadline shorter than the wait: 504, and no Retry-After.
    async def hurried() -> openai.APIStatusError:
        client = _client(server, key)
        holder = asyncio.create_task(
            client.chat.completions.create(model="m", messages=MESSAGES)
        )
        await asyncio.sleep(0.1)
        holder2 = asyncio.create_task(
            client.chat.completions.create(model="m", messages=MESSAGES)
        )
        await asyncio.sleep(0.1)
        try:
            await client.chat.completions.create(
                model="m",
                messages=MESSAGES,
                extra_headers={"X-Nexus-Deadline-Ms": "200"},
            )
        except openai.APIStatusError as error:
            await asyncio.gather(holder, holder2)
            return error
        raise AssertionError("the deadline was not enforced")

    late = asyncio.run(hurried())
    assert (late.status_code, late.code) == (504, "deadline_exceeded")
    assert "retry-after" not in late.response.headers
    bad = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES},
        headers={"Authorization": f"Bearer {key}", "X-Nexus-Criticality": "urgent"},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "X-Nexus-Criticality"
    wait_until(lambda: server.metric("nexus_admission_stock_level") == 0)


def test_two_serving_processes_keep_the_gateways_in_flight_within_the_band(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    mock = mock_backend_factory(
        "--models", "m", "--name", "wide", "--slots", "100", "--latency-ms", "300"
    )
    _backend(mock, "wide")
    # Lower 3.6, upper 4.4: at most 5 in flight for the gateway as a whole.
    _configure(watermark_per_backend=4.0)
    _, key = ApiKey.objects.create_key("both")
    if PRODUCTION:  # the processes find each other in Redis
        servers = [nexus_server_factory(), nexus_server_factory()]
    else:  # the launcher tells them (nexus_run sets these)
        servers = [
            nexus_server_factory(
                NEXUS_SERVING_PROCESSES="2", NEXUS_SERVING_INDEX=str(index)
            )
            for index in range(2)
        ]
    for server in servers:
        httpx.get(f"{server.base_url}/health/live")  # start the gateway
        wait_until(lambda s=server: s.metric("nexus_admission_serving_processes") == 2)

    async def flood() -> None:
        clients = [_client(server, key) for server in servers]
        await asyncio.gather(
            *(
                clients[i % 2].chat.completions.create(model="m", messages=MESSAGES)
                for i in range(30)
            )
        )

    asyncio.run(flood())
    stats = mock_stats(mock)
    assert stats["requests"]["/v1/chat/completions"] == 30
    assert 4 <= stats["peak_outstanding"] <= 5
    for server in servers:
        wait_until(lambda s=server: s.metric("nexus_admission_stock_level") == 0)


@pytest.mark.parametrize(("max_concurrency", "bypassed"), [(8, 8), (None, 5)])
def test_an_idle_backend_takes_its_max_concurrency_before_anything_waits(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
    max_concurrency: int | None,
    bypassed: int,
) -> None:
    # A server that runs 8 at once: with its max_concurrency said, 8 requests
    # at once on an idle fleet all go straight through; without it, the
    # default band (4 per backend + 10 %) lets 5 through and queues the rest.
    # Those let through wait at the mock until all 8 have arrived there, or
    # the others are queued, however slowly a loaded machine sends them (CI
    # runs saw the first answered before the last arrived: peak 7, and a
    # sixth let through).
    mock = mock_backend_factory(
        "--models", "m", "--name", "wide", "--slots", "8", "--latency-ms", "300"
    )
    httpx.post(f"{mock.base_url}/_mock/hold", json={"first": 8})
    backend = Backend.objects.create(
        name="wide",
        base_url=mock.base_url,
        status=HealthStatus.HEALTHY,
        max_concurrency=max_concurrency,
    )
    BackendModel.objects.create(backend=backend, name="m")
    _, key = ApiKey.objects.create_key("eight")
    server = nexus_server_factory()

    async def scenario() -> None:
        client = _client(server, key)
        calls = [
            asyncio.ensure_future(
                client.chat.completions.create(model="m", messages=MESSAGES)
            )
            for _ in range(8)
        ]
        if bypassed < 8:
            await asyncio.to_thread(
                wait_until,
                lambda: server.metric("nexus_admission_queue_length") == 8 - bypassed,
                what="the others queued",
            )
            await asyncio.to_thread(httpx.post, f"{mock.base_url}/_mock/release")
        await asyncio.gather(*calls)

    asyncio.run(scenario())
    assert server.metric("nexus_admission_bypass_total") == bypassed
    assert mock_stats(mock)["peak_outstanding"] == bypassed


def test_aliases_and_fallbacks_wait_in_the_pool_of_the_backend_that_serves(
    slotted: MockBackendProcess,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    # "m" on the slotted backend, one at a time. "gone" is served only by a
    # backend that is down, with "m" as its fallback; "alias" names "m".
    _configure(lower_bound_per_backend=1.0, upper_bound_per_backend=1.0)
    down = Backend.objects.create(
        name="down", base_url="http://127.0.0.1:9", status=HealthStatus.UNHEALTHY
    )
    BackendModel.objects.create(backend=down, name="gone")
    Alias.objects.create(name="alias", target="m")
    FallbackChain.objects.create(model="gone").set_fallbacks(["m"])
    _, key = ApiKey.objects.create_key("three-names")
    server = nexus_server_factory()
    # The one let through waits at the mock until the other five wait in
    # Nexus, however slowly a loaded machine sends them (at 300 ms each they
    # could otherwise arrive one after another and each go straight through).
    httpx.post(f"{slotted.base_url}/_mock/hold", json={"first": 100})

    async def scenario() -> None:
        client = _client(server, key, timeout=60)
        calls = [
            asyncio.ensure_future(
                client.chat.completions.create(model=name, messages=MESSAGES)
            )
            for name in ("m", "alias", "gone", "gone", "alias", "m")
        ]
        await asyncio.to_thread(
            wait_until,
            lambda: server.metric("nexus_admission_queue_length") == 5,
            60,
            "five requests waiting behind the one let through",
        )
        # Each by the name asked for (any of the six may be the one let
        # through), all for the model that serves them.
        waiting = {
            name: server.metric(
                "nexus_admission_queue_length", f'model="{name}",target_model="m"'
            )
            for name in ("m", "alias", "gone")
        }
        assert sum(waiting.values()) == 5, waiting
        assert min(waiting.values()) >= 1, waiting
        await asyncio.to_thread(httpx.post, f"{slotted.base_url}/_mock/release")
        await asyncio.gather(*calls)

    asyncio.run(scenario())
    stats = mock_stats(slotted)
    assert stats["requests"]["/v1/chat/completions"] == 6
    # One band for all three names: the backend never had two at once.
    assert stats["peak_outstanding"] == 1
    assert server.metric("nexus_admission_dequeue_successes_total") == 5


def test_a_backend_enabled_while_requests_wait_serves_them_before_new_arrivals(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    # Issue 30's reproduction: one backend running one request at a time
    # holds one and queues two; the operator enables a second backend.
    first = mock_backend_factory("--models", "m", "--name", "first", "--slots", "1")
    second = mock_backend_factory(
        "--models", "m", "--name", "second", "--latency-ms", "200", "--slots", "4"
    )
    for name, mock, enabled in (("first", first, True), ("second", second, False)):
        backend = Backend.objects.create(
            name=name,
            base_url=mock.base_url,
            status=HealthStatus.HEALTHY,
            max_concurrency=1,
            enabled=enabled,
        )
        BackendModel.objects.create(backend=backend, name="m")
    enable = Backend.objects.get(name="second")
    token = Token.objects.create(user=StaffUserFactory()).key
    _, key = ApiKey.objects.create_key("patient")
    server = nexus_server_factory()
    httpx.post(f"{first.base_url}/_mock/hold", json={"first": 100})

    def served_by_second() -> int:
        return int(mock_stats(second)["requests"].get("/v1/chat/completions", 0))

    async def scenario() -> tuple[list[Any], list[Any]]:
        client = _client(server, key, timeout=60)

        def ask() -> asyncio.Future[Any]:
            return asyncio.ensure_future(
                client.chat.completions.with_raw_response.create(
                    model="m", messages=MESSAGES
                )
            )

        older = [ask() for _ in range(3)]
        await asyncio.to_thread(
            wait_until,
            lambda: server.metric("nexus_admission_queue_length") == 2,
            60,
            "two requests waiting",
        )
        changed = await asyncio.to_thread(
            httpx.patch,
            f"{server.base_url}/api/v1/backends/{enable.pk}",
            json={"enabled": True},
            headers={"Authorization": f"Token {token}"},
            timeout=30,
        )
        assert changed.status_code == 200, changed.text
        # The two that waited go to the new backend, without a new arrival
        # to wake them, while the first backend still holds its request.
        await asyncio.to_thread(
            wait_until,
            lambda: served_by_second() == 2,
            60,
            "the new backend to serve the two waiting requests",
        )
        newer = [ask() for _ in range(3)]
        done_newer = await asyncio.gather(*newer, return_exceptions=True)
        await asyncio.to_thread(httpx.post, f"{first.base_url}/_mock/release")
        done_older = await asyncio.gather(*older, return_exceptions=True)
        return done_older, done_newer

    older, newer = asyncio.run(scenario())
    for reply in [*older, *newer]:
        assert not isinstance(reply, BaseException), reply
    backends = [reply.headers["x-nexus-backend"] for reply in older]
    assert sorted(backends) == ["first", "second", "second"]
    # Capacity added never turns into refusals: the newcomers queued, then
    # went to the new backend one at a time.
    assert [reply.headers["x-nexus-backend"] for reply in newer] == ["second"] * 3
    assert mock_stats(second)["peak_outstanding"] == 1


def _held_backend(
    mock_backend_factory: Callable[..., MockBackendProcess], model: str
) -> MockBackendProcess:
    """A backend serving `model` one request at a time (its max_concurrency),
    holding every request until released."""
    mock = mock_backend_factory("--models", model, "--name", model, "--slots", "4")
    httpx.post(f"{mock.base_url}/_mock/hold", json={"first": 100})
    _backend(mock, model, model, max_concurrency=1)
    return mock


async def _ask(server: NexusServer, key: str, model: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": model, "messages": MESSAGES},
            headers={"Authorization": f"Bearer {key}"},
        )


def _waiting(*servers: NexusServer) -> float:
    return sum(server.metric("nexus_admission_queue_length") for server in servers)


async def _until(condition: Callable[[], Any], what: str) -> None:
    await asyncio.to_thread(wait_until, condition, 60, what)


def test_total_capacity_counts_the_requests_waiting_for_every_model(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    # Two models, each on a backend running one request at a time: with room
    # for 2 waiting requests in the gateway, one waiting for each model fills
    # it (each model's pool alone would have room for a second).
    mocks = [_held_backend(mock_backend_factory, model) for model in ("m", "n")]
    _configure(total_capacity=2, flow_capacity=2, critical_reserved=0)
    _, key = ApiKey.objects.create_key("two models")
    _, other_key = ApiKey.objects.create_key("another flow")
    server = nexus_server_factory()

    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        running = [asyncio.ensure_future(_ask(server, key, m)) for m in ("m", "n")]
        await _until(
            lambda: all(mock_stats(mock)["busy_slots"] == 1 for mock in mocks),
            "one request held at each backend",
        )
        for model in ("m", "n"):
            running.append(asyncio.ensure_future(_ask(server, key, model)))
        await _until(lambda: _waiting(server) == 2, "one waiting per model")
        refused = await _ask(server, other_key, "m")
        for mock in mocks:
            await asyncio.to_thread(httpx.post, f"{mock.base_url}/_mock/release")
        return await asyncio.gather(*running), refused

    served, refused = asyncio.run(scenario())
    assert [reply.status_code for reply in served] == [200] * 4
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "queue_full"
    assert "2 requests may wait, over every model" in error["message"]
    assert refused.headers["retry-after"] == "1"
    wait_until(lambda: server.metric("nexus_admission_stock_level") == 0)


@pytest.mark.skipif(not PRODUCTION, reason="production mode (processes share Redis)")
def test_queue_and_flow_capacities_hold_for_two_serving_processes_together(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    # One backend running two requests at a time (one per serving process's
    # share); 3 may wait in the gateway, 2 of them of one flow (one key).
    mock = _held_backend(mock_backend_factory, "m")
    Backend.objects.filter(name="m").update(max_concurrency=2)
    _configure(total_capacity=3, flow_capacity=2, critical_reserved=0)
    _, first_key = ApiKey.objects.create_key("first")
    _, second_key = ApiKey.objects.create_key("second")
    servers = [nexus_server_factory(), nexus_server_factory()]
    for server in servers:
        httpx.get(f"{server.base_url}/health/live")  # start the gateway
        wait_until(lambda s=server: s.metric("nexus_admission_serving_processes") == 2)

    async def scenario() -> tuple[list[httpx.Response], list[httpx.Response]]:
        running = [asyncio.ensure_future(_ask(s, first_key, "m")) for s in servers]
        await _until(lambda: mock_stats(mock)["busy_slots"] == 2, "two held")
        refused = []
        # The first key's flow: one waits in each process, the third finds
        # the flow's 2 places taken (each process alone had room for it).
        for server, waiting in ((servers[0], 1), (servers[1], 2)):
            running.append(asyncio.ensure_future(_ask(server, first_key, "m")))
            await _until(
                lambda w=waiting: _waiting(*servers) == w, f"{waiting} waiting"
            )
        refused.append(await _ask(servers[0], first_key, "m"))
        # Another key: one more place in the gateway, then none.
        running.append(asyncio.ensure_future(_ask(servers[1], second_key, "m")))
        await _until(lambda: _waiting(*servers) == 3, "3 waiting")
        refused.append(await _ask(servers[0], second_key, "m"))
        await asyncio.to_thread(httpx.post, f"{mock.base_url}/_mock/release")
        return await asyncio.gather(*running), refused

    served, refused = asyncio.run(scenario())
    assert [reply.status_code for reply in served] == [200] * 5
    assert [reply.status_code for reply in refused] == [503, 503]
    assert [reply.json()["error"]["code"] for reply in refused] == [
        "flow_queue_full",
        "queue_full",
    ]
    assert (
        "over every model and serving process" in refused[1].json()["error"]["message"]
    )
    for server in servers:
        wait_until(lambda s=server: s.metric("nexus_admission_stock_level") == 0)


def test_in_tokens_ten_long_prompts_wait_where_ten_short_ones_go_through(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    # stock_unit = "tokens": a backend is aimed at 4,000 estimated tokens in
    # flight (+-10 %, a request goes through while fewer than 4,400 are).
    # Ten short questions (a few tokens each, max_tokens 16) all go through
    # at once; of ten prompts of 10,000 characters (2,500 tokens by the
    # estimate), two do and eight wait.
    mock = mock_backend_factory("--models", "m", "--name", "tokens", "--slots", "20")
    _backend(mock, "tokens")
    _configure(stock_unit="tokens", watermark_tokens_per_backend=4000)
    _, key = ApiKey.objects.create_key("sizes")
    server = nexus_server_factory()
    long_prompt = "word " * 2000

    async def burst(content: str, let_through: int) -> None:
        await asyncio.to_thread(
            httpx.post, f"{mock.base_url}/_mock/hold", json={"first": 100}
        )
        client = _client(server, key, timeout=60)
        calls = [
            asyncio.ensure_future(
                client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": content}],
                    max_tokens=16,
                )
            )
            for _ in range(10)
        ]
        await _until(
            lambda: (
                mock_stats(mock)["busy_slots"] == let_through
                and _waiting(server) == 10 - let_through
            ),
            f"{let_through} at the backend, {10 - let_through} waiting",
        )
        assert mock_stats(mock)["busy_slots"] == let_through
        await asyncio.to_thread(httpx.post, f"{mock.base_url}/_mock/release")
        await asyncio.gather(*calls)

    asyncio.run(burst("What is 2 + 2?", 10))
    assert server.metric("nexus_admission_bypass_total") == 10
    asyncio.run(burst(long_prompt, 2))
    wait_until(lambda: server.metric("nexus_admission_stock_tokens") == 0)
    assert server.metric("nexus_admission_dequeue_successes_total") == 8
