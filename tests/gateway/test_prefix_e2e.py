"""Prefix-aware routing end to end: Daphne serving Nexus, mock servers with
prompt caches, the official openai and anthropic clients.

A tenant's second request goes where its first did (and finds its prompt in
that server's cache), a session sticks, two hot tenants homed on one node are
spread by the load guard, and the explain API and x-nexus-route-reason name
the signal and the matched length.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import RoutingPolicy
from tests.conftest import MockBackendProcess, NexusServer, mock_stats, wait_until
from tests.factories import StaffUserFactory
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)

NODES = ("node-a", "node-b", "node-c")
Factory = Callable[..., MockBackendProcess]


def _start(
    factory: Factory, nexus_server_factory: Callable[..., NexusServer], *extra: str
) -> tuple[NexusServer, dict[str, MockBackendProcess], str]:
    mocks = {}
    for name in NODES:
        mocks[name] = factory(
            "--name", name, "--models", "m", "--prefix-block-chars", "64",
            "--prefix-cache-blocks", "10000", *extra,
        )  # fmt: skip
        backend = Backend.objects.create(
            name=name, base_url=mocks[name].base_url, status=HealthStatus.HEALTHY
        )
        BackendModel.objects.create(backend=backend, name="m")
    policy = RoutingPolicy.load()
    policy.prefix_enabled = True
    policy.prefix_max_imbalance = 1
    policy.prefix_max_imbalance_ratio = 0
    policy.admission_enabled = False
    policy.full_clean()
    policy.save()
    _, key = ApiKey.objects.create_key("prefix")
    return nexus_server_factory(), mocks, key


def _system(tenant: str) -> str:
    return f"You are {tenant}'s assistant. " + f"{tenant} policy text. " * 120


def _ask(client: openai.OpenAI, tenant: str, *turns: str) -> tuple[str, str]:
    backend, reason, _ = _ask_with_id(client, tenant, *turns)
    return backend, reason


def _ask_with_id(
    client: openai.OpenAI, tenant: str, *turns: str
) -> tuple[str, str, str]:
    messages: list[Any] = [{"role": "system", "content": _system(tenant)}]
    messages += [{"role": "user", "content": turn} for turn in turns]
    raw = client.chat.completions.with_raw_response.create(model="m", messages=messages)
    headers = raw.headers
    return (
        headers["x-nexus-backend"],
        headers["x-nexus-route-reason"],
        headers["x-request-id"],
    )


def _client(server: NexusServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, timeout=30, max_retries=0
    )


def test_a_tenants_next_request_lands_where_its_first_did(
    mock_backend_factory: Factory, nexus_server_factory: Callable[..., NexusServer]
) -> None:
    server, mocks, key = _start(mock_backend_factory, nexus_server_factory)
    client = _client(server, key)
    first, reason = _ask(client, "acme", "hello")
    assert reason.startswith("strategy; blocks=0/")
    homes = {}
    for tenant in ("globex", "initech"):
        homes[tenant] = _ask(client, tenant, "hello")[0]
    asked = []
    for turn in range(3):
        backend, reason, request_id = _ask_with_id(
            client, "acme", "hello", f"and then {turn}"
        )
        assert backend == first
        signal, blocks = reason.split("; ")[:2]
        assert signal == "prefix"
        matched, total = blocks.removeprefix("blocks=").split("/")
        assert int(matched) >= 0.9 * int(total) - 1
        asked.append(request_id)
    # The server found the prompt in its cache: all but the new turn's blocks.
    held = mock_stats(mocks[first])["prefix_requests"]
    for request_id in asked:
        found, blocks = held[request_id]
        assert found >= 0.9 * blocks - 1
    assert server.metric("nexus_prefix_decisions_total", 'signal="prefix"') == 3
    assert server.metric("nexus_prefix_matched_blocks_count") == 6


def test_a_session_sticks_to_its_backend_through_the_anthropic_client(
    mock_backend_factory: Factory, nexus_server_factory: Callable[..., NexusServer]
) -> None:
    server, _, key = _start(mock_backend_factory, nexus_server_factory)
    client = anthropic.Anthropic(
        base_url=server.base_url, api_key=key, timeout=30, max_retries=0
    )
    seen = []
    for turn in range(4):
        # A different short prompt each time: only the session ties them.
        raw = client.messages.with_raw_response.create(
            model="m",
            max_tokens=16,
            messages=[{"role": "user", "content": f"question {turn}"}],
            metadata={"user_id": "user-42"},
        )
        seen.append(
            (raw.headers["x-nexus-backend"], raw.headers["x-nexus-route-reason"])
        )
    assert len({backend for backend, _ in seen}) == 1
    assert [reason.split(";")[0] for _, reason in seen[1:]] == ["session"] * 3
    assert server.metric("nexus_prefix_session_hits_total") == 3


def test_two_hot_tenants_on_one_node_are_spread_by_the_load_guard(
    mock_backend_factory: Factory, nexus_server_factory: Callable[..., NexusServer]
) -> None:
    server, mocks, key = _start(
        mock_backend_factory, nexus_server_factory, "--latency-ms", "1500"
    )
    client = _client(server, key)
    token = Token.objects.create(user=StaffUserFactory()).key
    # Both tenants are first served while node-a is the only node up.
    Backend.objects.exclude(name="node-a").update(status=HealthStatus.UNHEALTHY)
    _bump_config()
    wait_until(lambda: len(_candidates(server, token)) == 1)
    homes = {_ask(client, tenant, "warm up")[0] for tenant in ("hot-1", "hot-2")}
    assert homes == {"node-a"}
    Backend.objects.update(status=HealthStatus.HEALTHY)
    _bump_config()
    wait_until(lambda: len(_candidates(server, token)) == 3)

    async def burst() -> list[tuple[str, str]]:
        return await asyncio.gather(
            *(
                asyncio.to_thread(_ask, client, f"hot-{1 + n % 2}", f"q{n}")
                for n in range(9)
            )
        )

    answers = asyncio.run(burst())
    served = Counter(backend for backend, _ in answers)
    reasons = Counter(reason.split(";")[0] for _, reason in answers)
    # The guard (1 request over the least loaded) kept node-a from taking all.
    assert len(served) >= 2, served
    assert served["node-a"] < 9
    assert reasons["load-guard"] >= 1, reasons
    assert server.metric("nexus_prefix_guard_overrides_total") >= 1
    assert mock_stats(mocks["node-a"])["peak_outstanding"] <= 5


def _bump_config() -> None:
    # A queryset update sends no signal: save the policy to announce it.
    RoutingPolicy.load().save()


def _candidates(server: NexusServer, token: str) -> list[dict[str, Any]]:
    answer = httpx.post(
        f"{server.base_url}/api/v1/route/explain",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": f"Token {token}"},
        timeout=5,
    )
    candidates: list[dict[str, Any]] = answer.json()["candidates"]
    return candidates


def test_explain_names_the_prefix_signal_and_the_matched_length(
    mock_backend_factory: Factory, nexus_server_factory: Callable[..., NexusServer]
) -> None:
    server, _, key = _start(mock_backend_factory, nexus_server_factory)
    home, _ = _ask(_client(server, key), "acme", "hello")
    token = Token.objects.create(user=StaffUserFactory()).key
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": _system("acme")},
            {"role": "user", "content": "hello"},
            {"role": "user", "content": "more"},
        ],
    }

    def explain() -> dict[str, Any]:
        answer = httpx.post(
            f"{server.base_url}/api/v1/route/explain",
            json=body,
            headers={"Authorization": f"Token {token}"},
            timeout=5,
        )
        result: dict[str, Any] = answer.json()
        return result

    # Daphne may serve the API from the same process as the proxy: one
    # process here, so it reads the index the request above filled.
    decision = wait_until(lambda: (d := explain())["prefix"]["matched_blocks"] and d)
    assert decision["chosen"]["backend"] == home
    assert decision["prefix"]["signal"] == "prefix"
    assert decision["prefix"]["reuse"] > 0.85
