"""Learned capacity end to end: what mock Ollama nodes report and how loads fail.

Memory another client's model takes on a node, as a real health round reads it
from the node's /api/ps, moves the fleet's choice; repeated out-of-memory load
failures seen by a serving process (Daphne serving Nexus, the openai SDK as
client) pause new cold loads on that node, as its explain API shows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token

from backends.discovery import discover_models
from backends.health import check_all
from backends.models import Backend, BackendModel, HealthStatus
from routing.core import LiveStats, RequestRequirements, Router
from routing.core.decision import Decision
from routing.models import RoutingPolicy
from routing.snapshot import build_snapshot
from tests.conftest import MockBackendProcess, NexusServer, mock_stats, wait_until
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)

Factory = Callable[..., MockBackendProcess]
GB = 1_000_000_000


def _fleet_policy() -> None:
    policy = RoutingPolicy.load()
    policy.strategy = "fleet"
    policy.save()


def _node(factory: Factory, name: str, memory_gb: float, *models: str) -> Any:
    sizes = [arg for model in models for arg in ("--model", f"{model}:8")]
    return factory(
        "--kind",
        "ollama",
        "--name",
        name,
        *sizes,
        "--memory-gb",
        str(memory_gb),
        "--loaded-models",
        "",
    )


def _configure(mock: MockBackendProcess, **knobs: Any) -> None:
    httpx.post(f"{mock.base_url}/_mock/config", json=knobs).raise_for_status()


def _decide(model: str) -> Decision:
    return Router().explain(
        RequestRequirements(model=model), build_snapshot(), LiveStats()
    )


def test_memory_another_client_takes_on_a_node_moves_the_fleets_choice(
    mock_backend_factory: Factory, admin_client: Client
) -> None:
    a = _node(mock_backend_factory, "a", 24, "m")
    b = _node(mock_backend_factory, "b", 24, "m")
    for name, mock, priority in (("a", a, 0), ("b", b, 5)):
        Backend.objects.create(
            name=name,
            base_url=mock.base_url,
            kind="ollama",
            priority=priority,
            memory_ceiling_gb=24.0,
        )
    _fleet_policy()
    discover_models()
    check_all()
    before = _decide("m")

    # Another client loads a 20 GB model on a; the next health round reads it.
    _configure(a, resident_models={"qwen2.5:32b": 20.0})
    check_all()
    after = _decide("m")

    assert before.chosen is not None and before.chosen.backend.name == "a"
    row = Backend.objects.get(name="a")
    assert (row.memory_used_bytes, row.memory_pressure) == (20 * GB, False)
    assert after.chosen is not None and after.chosen.backend.name == "b"
    (excluded,) = after.as_dict()["excluded"]
    assert (excluded["backend"], excluded["reasons"]) == ("a", ["no_memory"])
    assert "ceiling 24.00 GB, 20.00 GB in use, model 8.00 GB" in excluded["detail"]
    page = admin_client.get(reverse("admin:backends_backend_change", args=[row.pk]))
    assert "20.0 GB in use" in page.content.decode()
    # Gone again: the node is chosen again after the next round.
    _configure(a, resident_models={})
    check_all()
    again = _decide("m")
    assert again.chosen is not None and again.chosen.backend.name == "a"


def _short_of_memory_fleet(factory: Factory) -> tuple[Any, Any]:
    """Nodes a (preferred, 10 GB with another client's 5 GB model: every 8 GB
    load fails "out of memory") and b (40 GB), both serving m, n and k, under
    the fleet strategy."""
    a = _node(factory, "a", 10, "m", "n", "k")
    b = _node(factory, "b", 40, "m", "n", "k")
    _configure(a, resident_models={"other:7b": 5.0}, oom_loads="runner")
    for name, mock, priority in (("a", a, 0), ("b", b, 5)):
        backend = Backend.objects.create(
            name=name,
            base_url=mock.base_url,
            kind="ollama",
            priority=priority,
            status=HealthStatus.HEALTHY,
        )
        for model in ("m", "n", "k"):
            BackendModel.objects.create(
                backend=backend, name=model, size_bytes=8 * GB, discovered=True
            )
    _fleet_policy()
    return a, b


def _admin_page(server: NexusServer, path: str, username: str, password: str) -> str:
    """An admin page as a signed-in operator's browser gets it from `server`."""
    with httpx.Client(base_url=server.base_url, timeout=10) as browser:
        browser.get("/admin/login/")
        signed_in = browser.post(
            "/admin/login/",
            data={
                "username": username,
                "password": password,
                "csrfmiddlewaretoken": browser.cookies["csrftoken"],
                "next": path,
            },
            headers={"Referer": f"{server.base_url}/admin/login/"},
        )
        assert signed_in.status_code == 302, signed_in.text[:500]
        page = browser.get(path)
        assert page.status_code == 200
        return page.text


@pytest.mark.skipif(
    not settings.REDIS_URL, reason="serving processes share news through Redis"
)
def test_out_of_memory_failures_seen_by_one_serving_process_pause_the_node_in_all(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    a, _ = _short_of_memory_fleet(mock_backend_factory)
    _, key = ApiKey.objects.create_key("capacity")
    get_user_model().objects.create_superuser("oom-ops", password="oom-pw")
    first, second = nexus_server_factory(), nexus_server_factory()
    sdk = openai.OpenAI(base_url=f"{first.base_url}/v1", api_key=key, max_retries=0)
    for model in ("m", "n"):  # both fail to load on a, and go to b
        sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}]
        )
    assert mock_stats(a)["loads_refused"] == 2

    # The other serving process heard of both: it pauses a too.
    def paused_there() -> bool:
        page = _admin_page(second, "/admin/backends/backend/", "oom-ops", "oom-pw")
        return "cold loads paused" in page

    wait_until(paused_there, 15, "the second process to pause a")
    other = openai.OpenAI(base_url=f"{second.base_url}/v1", api_key=key, max_retries=0)
    reply = other.chat.completions.with_raw_response.create(
        model="k", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.headers["x-nexus-backend"] == "b"
    assert mock_stats(a)["loads_refused"] == 2  # a was not asked to load k


def test_repeated_out_of_memory_loads_pause_cold_loads_on_that_node(
    mock_backend_factory: Factory,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    # a is preferred (priority) but short of memory: another client's 5 GB
    # model sits in its 10 GB, so no 8 GB model loads there; its GPU says so
    # only by failing the load ("CUDA error: out of memory").
    a, b = _short_of_memory_fleet(mock_backend_factory)
    _, key = ApiKey.objects.create_key("capacity")
    staff = get_user_model().objects.create_user(
        "capacity-ops", is_staff=True, is_superuser=True
    )
    token = Token.objects.create(user=staff).key
    server = nexus_server_factory()
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)

    def ask(model: str) -> str:
        reply = sdk.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}]
        )
        return str(reply.headers["x-nexus-backend"])

    def explain(model: str) -> dict[str, Any]:
        answer: dict[str, Any] = httpx.post(
            f"{server.base_url}/api/v1/route/explain",
            json={"model": model},
            headers={"Authorization": f"Token {token}"},
            timeout=5,
        ).json()
        return answer

    # Two loads fail on a (each request is retried on b: the client never
    # sees it).
    assert explain("m")["chosen"]["backend"] == "a"
    assert ask("m") == "b"
    assert explain("n")["chosen"]["backend"] == "a"
    assert ask("n") == "b"
    assert mock_stats(a)["loads_refused"] == 2

    # Now a third model cold everywhere goes straight to b.
    decision = explain("k")
    assert decision["chosen"]["backend"] == "b"
    (excluded,) = decision["excluded"]
    assert (excluded["backend"], excluded["reasons"]) == ("a", ["cold_loads_paused"])
    assert "2 out-of-memory load failures" in excluded["detail"]
    assert "CUDA error: out of memory" in excluded["detail"]
    assert ask("k") == "b"
    assert mock_stats(a)["loads_refused"] == 2  # a was not asked to load k

    # The admin, served by the same process, shows the pause on the list.
    staff.set_password("capacity-pw")
    staff.is_superuser = True
    staff.save()
    page = _admin_page(
        server, "/admin/backends/backend/", "capacity-ops", "capacity-pw"
    )
    assert page.count("cold loads paused") == 1
    assert "2 out-of-memory load failures" in page

    # A streamed answer's decoding speed teaches b's memory bandwidth, which
    # the wait guess uses until enough answers were timed.
    wait = explain("k")["candidates"][0]["fleet"]["estimated_wait"]
    assert (wait["source"], wait["bandwidth_gbps"]) == ("heuristic", None)
    _configure(b, chunk_delay_ms=40)
    words = " ".join(["word"] * 60)
    stream = sdk.chat.completions.create(
        model="k", messages=[{"role": "user", "content": words}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    wait = explain("k")["candidates"][0]["fleet"]["estimated_wait"]
    assert wait["source"] == "bandwidth"
    assert wait["bandwidth_gbps"] > 0
