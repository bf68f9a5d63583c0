"""Fleet scheduling end to end: Daphne serving Nexus, mock Ollama nodes, openai SDK.

The queues (full, timed out, a client leaving), a warm-up on the runner-up
that the mock counts, a rebalance to a node where the model is hot, and the
holding queue (a backend back in time, else the fallback, else a 503).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import ChainStep, FallbackChain, RoutingPolicy
from tests.conftest import MockBackendProcess, NexusServer, mock_stats, wait_until
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "hi"}]
Factory = Callable[..., MockBackendProcess]


def _served(mock: MockBackendProcess) -> int:
    return int(mock_stats(mock)["requests"].get("/v1/chat/completions", 0))


def _policy(strategy: str = "fleet", **fields: Any) -> None:
    policy = RoutingPolicy.load()
    policy.strategy = strategy
    # Admission control stays on (the default): under fleet its band lets
    # through what the nodes' lines may hold, so requests line up at a node.
    for name, value in fields.items():
        setattr(policy, name, value)
    policy.full_clean()
    policy.save()


def _node(factory: Factory, name: str, *extra: str) -> MockBackendProcess:
    return factory("--kind", "ollama", "--name", name, "--models", "m", *extra)


def _backend(
    mock: MockBackendProcess,
    name: str,
    *,
    model: str = "m",
    loaded: bool = True,
    max_concurrency: int | None = None,
    status: str = HealthStatus.HEALTHY,
) -> Backend:
    backend = Backend.objects.create(
        name=name,
        base_url=mock.base_url,
        kind="ollama",
        status=status,
        max_concurrency=max_concurrency,
    )
    BackendModel.objects.create(backend=backend, name=model, loaded=loaded)
    return backend


def _client(server: NexusServer, key: str, timeout: float = 30) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=timeout
    )


def test_a_full_queue_and_a_long_wait_answer_503_in_openai_shape(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    # Long enough that the third request finds the line still full on a
    # loaded machine; then the second one times out, then the first answers.
    # The third request has the queue timeout (5 s) from the second one's
    # queueing to arrive: a fresh clone's loaded run once took longer than 3.
    slow = _node(mock_backend_factory, "slow", "--latency-ms", "8000")
    _backend(slow, "slow", max_concurrency=1)
    # Admission off: on, it admits what the line holds (slots + length) and
    # keeps the third request in its own fair queue instead of refusing it.
    _policy(
        fleet_queue_length=1, fleet_queue_timeout_seconds=5, admission_enabled=False
    )
    _, key = ApiKey.objects.create_key("fleet")
    server = nexus_server_factory()

    async def scenario() -> tuple[Any, Any, Any]:
        client = _client(server, key)
        running = asyncio.create_task(
            client.chat.completions.create(model="m", messages=MESSAGES)
        )
        await asyncio.to_thread(wait_until, lambda: mock_stats(slow)["in_flight"] == 1)
        waiting = asyncio.create_task(
            client.chat.completions.create(model="m", messages=MESSAGES)
        )
        await asyncio.to_thread(
            wait_until, lambda: server.metric("nexus_fleet_queue_waiting") == 1
        )
        with pytest.raises(openai.InternalServerError) as full:
            await client.chat.completions.create(model="m", messages=MESSAGES)
        with pytest.raises(openai.InternalServerError) as late:
            await waiting
        return full.value, late.value, await running

    full, late, answer = asyncio.run(scenario())
    assert full.status_code == 503
    assert full.body["code"] == "queue_full"  # type: ignore[index]
    assert full.body["type"] == "server_error"  # type: ignore[index]
    assert "full" in full.message
    assert int(full.response.headers["retry-after"]) >= 1
    assert late.status_code == 503
    assert late.body["code"] == "queue_timeout"  # type: ignore[index]
    assert int(late.response.headers["retry-after"]) >= 1
    assert answer.choices[0].message.content.endswith("echo: hi")
    assert _served(slow) == 1  # neither refused request reached the backend
    assert server.metric("nexus_fleet_queue_refusals_total") == 2


def test_a_client_leaving_while_queued_never_reaches_the_backend(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    slow = _node(mock_backend_factory, "slow", "--latency-ms", "5000")
    _backend(slow, "slow", max_concurrency=1)
    _policy()
    _, key = ApiKey.objects.create_key("fleet")
    server = nexus_server_factory()

    async def scenario() -> Any:
        client = _client(server, key)
        running = asyncio.create_task(
            client.chat.completions.create(model="m", messages=MESSAGES)
        )
        await asyncio.to_thread(wait_until, lambda: mock_stats(slow)["in_flight"] == 1)
        impatient = _client(server, key, timeout=1.0)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(model="m", messages=MESSAGES)
        # The place is freed at once, before the request in flight ends.
        await asyncio.to_thread(
            wait_until, lambda: server.metric("nexus_fleet_queue_waiting") == 0
        )
        assert not running.done()
        return await running

    scenario_answer = asyncio.run(scenario())
    assert scenario_answer.choices[0].message.content.endswith("echo: hi")
    time.sleep(0.3)
    assert _served(slow) == 1


def test_a_deep_queue_warms_the_model_on_the_runner_up_once(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    busy = mock_backend_factory(
        "--kind", "ollama", "--name", "busy", "--models", "m,other",
        "--latency-ms", "1500",
    )  # fmt: skip
    spare = _node(
        mock_backend_factory,
        "spare",
        "--loaded-models",
        "",
        "--load-seconds",
        "0.2",
    )
    _backend(busy, "busy", max_concurrency=1)
    _backend(spare, "spare", loaded=False, max_concurrency=1)
    _policy(pre_warm_threshold=3)
    _, key = ApiKey.objects.create_key("fleet")
    server = nexus_server_factory()

    async def scenario() -> list[Any]:
        client = _client(server, key)
        return await asyncio.gather(
            *(
                client.chat.completions.create(model="m", messages=MESSAGES)
                for _ in range(6)
            )
        )

    answers = asyncio.run(scenario())
    assert len(answers) == 6
    wait_until(
        lambda: server.metric("nexus_fleet_prewarm_total", 'outcome="loaded"') == 1
    )
    stats = mock_stats(spare)
    assert stats["loads"] == {"m": 1}
    assert stats["requests"].get("/api/generate") == 1


def test_waiting_requests_move_to_a_node_where_the_model_is_hot(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    busy = _node(mock_backend_factory, "busy", "--latency-ms", "3000")
    later = _node(mock_backend_factory, "later", "--latency-ms", "100")
    _backend(busy, "busy", max_concurrency=1)
    other = _backend(later, "later", max_concurrency=4, status=HealthStatus.UNHEALTHY)
    # Admission control on: the burst must still line up at `busy` (its band
    # under fleet is the slots plus what the lines hold, not the slots).
    _policy(
        rebalance_threshold=1,
        rebalance_interval_seconds=0.3,
        rebalance_max_moves=2,
        pre_warm_threshold=100,
        admission_enabled=True,
    )
    _, key = ApiKey.objects.create_key("fleet")
    server = nexus_server_factory()

    async def scenario() -> list[Any]:
        client = _client(server, key)
        tasks = [
            asyncio.create_task(
                client.chat.completions.create(model="m", messages=MESSAGES)
            )
            for _ in range(5)
        ]
        await asyncio.to_thread(
            wait_until, lambda: server.metric("nexus_fleet_queue_waiting") == 4
        )
        other.status = HealthStatus.HEALTHY  # hot there, with room
        await asyncio.to_thread(other.save)
        return await asyncio.gather(*tasks)

    started = time.monotonic()
    answers = asyncio.run(scenario())
    assert len(answers) == 5
    assert _served(later) >= 2  # moved, not waited for `busy` (3 s each)
    assert _served(busy) + _served(later) == 5
    moved = server.metric("nexus_fleet_rebalanced_total", 'destination="later"')
    assert moved == _served(later)
    assert time.monotonic() - started < 5 * 3


def _hold_setup(
    factory: Factory, hold: float, *, fallback: bool = False
) -> tuple[Backend, MockBackendProcess, MockBackendProcess | None]:
    down = _node(factory, "down")
    backend = _backend(down, "down", status=HealthStatus.UNHEALTHY)
    spare = None
    if fallback:
        spare = factory("--kind", "ollama", "--name", "spare", "--models", "f")
        _backend(spare, "spare", model="f")
        chain = FallbackChain.objects.create(model="m")
        ChainStep.objects.create(chain=chain, model="f", position=0)
    _policy(strategy="smart", hold_seconds=hold)
    return backend, down, spare


def test_a_held_request_is_served_by_a_backend_healthy_in_time(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    backend, _, _ = _hold_setup(mock_backend_factory, hold=20)
    _, key = ApiKey.objects.create_key("fleet")
    server = nexus_server_factory()
    answer: list[Any] = []

    def ask() -> None:
        client = openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=30
        )
        answer.append(
            client.chat.completions.with_raw_response.create(
                model="m", messages=MESSAGES
            )
        )

    asker = threading.Thread(target=ask)
    asker.start()
    wait_until(lambda: server.metric("nexus_fleet_held_requests") == 1)
    backend.status = HealthStatus.HEALTHY
    backend.save()
    asker.join(30)
    [raw] = answer
    assert raw.headers["x-nexus-backend"] == "down"
    assert raw.parse().choices[0].message.content.endswith("echo: hi")
    assert server.metric("nexus_fleet_hold_total", 'outcome="served"') == 1


def test_a_held_request_goes_to_the_fallback_when_the_hold_ends(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    _, down, spare = _hold_setup(mock_backend_factory, hold=1.0, fallback=True)
    _, key = ApiKey.objects.create_key("fleet")
    server = nexus_server_factory()
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=30
    )
    started = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    assert time.monotonic() - started >= 1.0
    assert raw.headers["x-nexus-model"] == "f"
    assert raw.headers["x-nexus-backend"] == "spare"
    assert _served(down) == 0
    assert spare is not None and _served(spare) == 1
    assert server.metric("nexus_fleet_hold_total", 'outcome="expired"') == 1


def test_a_held_request_without_a_fallback_gets_503_after_the_hold(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    _hold_setup(mock_backend_factory, hold=1.0)
    _, key = ApiKey.objects.create_key("fleet")
    server = nexus_server_factory()
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=30
    )
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert time.monotonic() - started >= 1.0
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "no_healthy_backend"  # type: ignore[index]


def test_without_a_hold_the_answer_is_immediate(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    _hold_setup(mock_backend_factory, hold=0)
    _, key = ApiKey.objects.create_key("fleet")
    server = nexus_server_factory()
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=30
    )
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert server.metric("nexus_fleet_hold_total") == 0


def test_an_ensemble_step_waits_in_the_line_of_a_busy_backend(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    """Under fleet a backend at its limit stays a candidate because the request
    waits there: an ensemble's step does too, rather than losing its opinion."""
    busy = mock_backend_factory(
        "--kind", "ollama", "--name", "busy", "--models", "m,other",
        "--latency-ms", "1500",
    )  # fmt: skip
    free = _node(mock_backend_factory, "free")
    _backend(busy, "busy", max_concurrency=1)
    BackendModel.objects.create(
        backend=Backend.objects.get(name="busy"), name="other", loaded=True
    )
    _backend(free, "free", max_concurrency=1)
    _policy(ensemble_opinions=2, ensemble_step_timeout_seconds=30)
    _, key = ApiKey.objects.create_key("fleet")
    server = nexus_server_factory()

    async def scenario() -> tuple[Any, Any]:
        client = _client(server, key)
        # The only backend serving "other" is busy with it for 1.5 s.
        running = asyncio.create_task(
            client.chat.completions.create(model="other", messages=MESSAGES)
        )
        await asyncio.to_thread(wait_until, lambda: mock_stats(busy)["in_flight"] == 1)
        raw = await client.chat.completions.with_raw_response.create(
            model="moe-m", messages=MESSAGES
        )
        return raw, await running

    raw, _ = asyncio.run(scenario())
    verdict = raw.headers["x-nexus-ensemble"]
    assert "opinions=2 of 2; answered=2" in verdict
    assert "critiques=2" in verdict
    asked = [r["body"] for r in mock_stats(busy)["last_requests"]]
    assert sum('"model": "m"' in b or '"model":"m"' in b for b in asked) >= 2
