"""Routing as a new operator meets it, through real processes (issue 12, items 1-3).

One Nexus server (Daphne) and three mock backends serve the module; the
official openai SDK is the client. Capabilities nobody declared do not block
requests, a model whose only backend dies is served by its fallback chain, and
a backend whose health result went stale gets no traffic.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.utils import timezone
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import Alias, ChainStep, FallbackChain
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey

HEALTH_INTERVAL = 2.0  # the server's: results older than 6 s are stale
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


@dataclass
class Fleet:
    server: NexusServer
    a: MockBackendProcess
    b: MockBackendProcess
    c: MockBackendProcess  # the only backend of "primary"; tests kill it
    key: str
    token: str

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.server.base_url}/v1", api_key=self.key, max_retries=0
        )

    def explain(self, model: str, **needs: object) -> dict:
        return httpx.post(
            f"{self.server.base_url}/api/v1/route/explain",
            json={"model": model, "messages": [{"role": "user", "content": "x"}]}
            | needs,
            headers={"Authorization": f"Token {self.token}"},
            timeout=5,
        ).json()


def _backend(name: str, process: MockBackendProcess, **fields: object) -> Backend:
    fields.setdefault("status", HealthStatus.HEALTHY)
    return Backend.objects.create(name=name, base_url=process.base_url, **fields)


@pytest.fixture(scope="module")
def fleet(django_db_setup: None, django_db_blocker) -> Iterator[Fleet]:
    a = start_mock_backend("--models", "qwen,shared,aging", "--name", "mock-a")
    b = start_mock_backend(
        "--models", "qwen,secondary,shared,aging", "--name", "mock-b"
    )
    c = start_mock_backend("--models", "primary", "--name", "mock-c")
    now = timezone.now()
    with django_db_blocker.unblock():
        # An OpenAI-compatible backend as discovery leaves it: capabilities
        # unknown (discovery cannot learn them from /v1/models).
        generic = _backend("generic", a, priority=5)
        BackendModel.objects.create(backend=generic, name="qwen", discovered=True)
        # A backend whose operator said "no tools": preferred, except for tools.
        no_tools = _backend("no-tools", b, priority=1)
        BackendModel.objects.create(backend=no_tools, name="qwen", supports_tools=False)
        dying = _backend("dying", c)
        BackendModel.objects.create(backend=dying, name="primary")
        spare = _backend("spare", b, priority=20)
        BackendModel.objects.create(backend=spare, name="secondary")
        chain = FallbackChain.objects.create(model="primary")
        ChainStep.objects.create(chain=chain, position=0, model="secondary")
        # Same priority order: stale first, so only staleness keeps it out.
        stale = _backend(
            "stale", a, priority=0, last_check_at=now - dt.timedelta(hours=1)
        )
        BackendModel.objects.create(backend=stale, name="shared")
        fresh = _backend("fresh", b, priority=9)
        BackendModel.objects.create(backend=fresh, name="shared")
        # Item 4: a switched-off backend, a model discovery saw vanish, and an
        # alias pointing at what nobody serves any more.
        retired = _backend("retired", a, enabled=False)
        BackendModel.objects.create(backend=retired, name="old-model")
        BackendModel.objects.create(
            backend=generic, name="vanished", discovered=True, enabled=False
        )
        Alias.objects.create(name="legacy", target="old-model")
        _, key = ApiKey.objects.create_key("routing-e2e")
        staff = get_user_model().objects.create_user(
            "routing-ops", is_staff=True, is_superuser=True
        )
        token = Token.objects.create(user=staff).key
    server = start_nexus_server(
        NEXUS_HEALTH_INTERVAL=str(HEALTH_INTERVAL),
        # The breaker would also end up skipping a dead backend; these tests
        # show that the very first failure continues into the chain.
        NEXUS_BREAKER_FAILURES="1000000",
    )
    try:
        yield Fleet(server, a, b, c, key, token)
    finally:
        server.stop()
        for process in (a, b, c):
            process.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# Item 1: tri-state capabilities


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_discovered_capabilities_start_unknown(fleet: Fleet) -> None:
    # Only reads: a test transaction holds SQLite's lock, which the server needs.
    qwen = BackendModel.objects.get(backend__name="generic", name="qwen")
    assert (qwen.supports_tools, qwen.supports_vision, qwen.supports_json_mode) == (
        None,
        None,
        None,
    )


def test_tools_reach_an_openai_backend_whose_capabilities_are_unknown(
    fleet: Fleet,
) -> None:
    raw = fleet.sdk().chat.completions.with_raw_response.create(
        model="qwen", messages=chat("weather?"), tools=TOOLS
    )
    assert raw.status_code == 200
    # "no-tools" has the better priority but said no; "generic" does not know.
    assert raw.headers["x-nexus-backend"] == "generic"
    plain = fleet.sdk().chat.completions.with_raw_response.create(
        model="qwen", messages=chat("hi")
    )
    assert plain.headers["x-nexus-backend"] == "no-tools"


def test_json_mode_is_not_refused_when_support_is_unknown(fleet: Fleet) -> None:
    reply = fleet.sdk().chat.completions.create(
        model="qwen",
        messages=chat("json please"),
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].message.content


def test_explain_shows_unknown_capabilities(fleet: Fleet) -> None:
    record = fleet.explain("qwen", tools=TOOLS)
    [candidate] = record["candidates"]
    assert candidate["backend"] == "generic"
    assert candidate["capabilities"]["tools"] == "unknown"
    [excluded] = record["excluded"]
    assert excluded["reasons"] == ["no_tools"]
    assert excluded["capabilities"]["tools"] == "no"


# Item 2: fallbacks on failure


@pytest.mark.parametrize("stream", [False, True])
def test_killing_the_only_backend_of_a_model_is_served_by_its_fallback(
    fleet: Fleet, stream: bool
) -> None:
    fleet.c.stop()  # connection refused from now on
    sdk = fleet.sdk()
    raw = sdk.chat.completions.with_raw_response.create(
        model="primary", messages=chat("still there?"), stream=stream
    )
    assert raw.status_code == 200
    assert raw.headers["x-nexus-backend"] == "spare"
    assert raw.headers["x-nexus-model"] == "secondary"
    if stream:
        text = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in raw.parse()
            if chunk.choices
        )
    else:
        text = raw.parse().choices[0].message.content
    assert "[mock-b/secondary]" in text


def test_explain_lists_the_retry_order_across_the_fallback_chain(
    fleet: Fleet,
) -> None:
    record = fleet.explain("primary")
    assert record["chosen"] == {"backend": "dying", "model": "primary"}
    assert record["retry_order"] == [{"backend": "spare", "model": "secondary"}]
    assert [attempt["model"] for attempt in record["onward"]] == ["secondary"]


# Item 3: stale health


def test_a_backend_with_a_stale_health_result_gets_no_traffic(fleet: Fleet) -> None:
    before = httpx.get(f"{fleet.a.base_url}/_mock/stats", timeout=5).json()
    sdk = fleet.sdk()
    for i in range(4):
        raw = sdk.chat.completions.with_raw_response.create(
            model="shared", messages=chat(f"n{i}")
        )
        assert raw.headers["x-nexus-backend"] == "fresh"
    after = httpx.get(f"{fleet.a.base_url}/_mock/stats", timeout=5).json()
    assert after["requests"].get("/v1/chat/completions", 0) == before["requests"].get(
        "/v1/chat/completions", 0
    )
    [excluded] = fleet.explain("shared")["excluded"]
    assert excluded["backend"] == "stale"
    assert excluded["reasons"] == ["health_stale"]


def test_a_backend_stops_getting_traffic_once_its_health_result_ages(
    fleet: Fleet, django_db_blocker
) -> None:
    # Checked 3 s ago: fresh for 3 s more, then stale (no beat runs here).
    checked = timezone.now() - dt.timedelta(seconds=3 * HEALTH_INTERVAL - 3)
    with django_db_blocker.unblock():
        aging = _backend("aging-1", fleet.a, priority=0, last_check_at=checked)
        BackendModel.objects.create(backend=aging, name="aging")
        other = _backend("aging-2", fleet.b, priority=9)
        BackendModel.objects.create(backend=other, name="aging")
    sdk = fleet.sdk()
    served: list[str] = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and served[-1:] != ["aging-2"]:
        try:
            raw = sdk.chat.completions.with_raw_response.create(
                model="aging", messages=chat("x")
            )
            served.append(raw.headers["x-nexus-backend"])
        except openai.NotFoundError:
            pass  # the new rows are not in the server's snapshot yet
        time.sleep(0.05)
    assert served[-1:] == ["aging-2"]
    # Only once it really was stale.
    assert timezone.now() >= checked + dt.timedelta(seconds=3 * HEALTH_INTERVAL)


# Item 4: models nobody serves


@pytest.mark.parametrize("model", ["old-model", "vanished", "legacy"])
def test_a_model_only_disabled_rows_list_is_404_model_not_found(
    fleet: Fleet, model: str
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        fleet.sdk().chat.completions.create(model=model, messages=chat("x"))
    assert caught.value.status_code == 404
    assert caught.value.code == "model_not_found"


def test_an_alias_whose_target_nobody_serves_is_not_listed(fleet: Fleet) -> None:
    listed = {m.id for m in fleet.sdk().models.list().data}
    assert "qwen" in listed
    assert not listed & {"legacy", "old-model", "vanished"}
