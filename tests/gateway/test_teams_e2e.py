"""A team's pool across two serving processes, with a key's own cap inside it.

Two Daphne processes share the database and the limiter's Redis (REDIS_URL's
in production mode; in the embedded default a private one, as nexus_run
starts it); the official openai SDK is the client, one key per process.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import RoutingPolicy
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey, Team

MESSAGES = [{"role": "user", "content": "count me"}]
# Each answer uses the same tokens; the pool holds exactly POOL of them.
POOL = 5
CAP = 2


@dataclass
class TeamCluster:
    servers: list[NexusServer]
    mock: MockBackendProcess
    keys: dict[str, str]

    def sdk(self, index: int, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.servers[index].base_url}/v1",
            api_key=self.keys[key],
            max_retries=0,
            timeout=20,
        )


def _tokens_per_answer(mock: MockBackendProcess) -> int:
    answer = httpx.post(
        f"{mock.base_url}/v1/chat/completions",
        json={"model": "llama3:8b", "messages": MESSAGES, "max_tokens": 16},
        timeout=10,
    )
    return int(answer.json()["usage"]["total_tokens"])


@pytest.fixture(scope="module")
def cluster(
    django_db_setup: None, django_db_blocker, shared_redis_env: dict[str, str]
) -> Iterator[TeamCluster]:
    mock = start_mock_backend("--models", "llama3:8b", "--name", "mock-team")
    tokens = _tokens_per_answer(mock)
    with django_db_blocker.unblock():
        backend = Backend.objects.create(
            name="mock-team", base_url=mock.base_url, status=HealthStatus.HEALTHY
        )
        BackendModel.objects.create(backend=backend, name="llama3:8b")
        policy = RoutingPolicy.load()
        policy.admission_enabled = False
        policy.save()
        team = Team.objects.create(
            name="research", budget_period="day", budget_tokens=POOL * tokens
        )
        keys = {
            "capped": ApiKey.objects.create_key(
                "team-capped",
                team=team,
                budget_period="day",
                budget_tokens=CAP * tokens,
            )[1],
            "pooled": ApiKey.objects.create_key("team-pooled", team=team)[1],
        }
    servers: list[NexusServer] = []
    try:
        for _ in range(2):
            servers.append(start_nexus_server(**shared_redis_env))
        yield TeamCluster(servers, mock, keys)
    finally:
        for server in servers:
            server.stop()
        mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def _ask(client: openai.OpenAI) -> str:
    """ "ok", or the message of the 429 that refused the request."""
    try:
        client.chat.completions.create(
            model="llama3:8b", messages=MESSAGES, max_tokens=16
        )
    except openai.RateLimitError as error:
        body = error.body
        assert isinstance(body, dict)
        assert body["code"] == "budget_exceeded"
        assert body["type"] == "insufficient_quota"
        return str(body["message"])
    return "ok"


def test_two_keys_exhaust_the_team_pool_exactly_with_a_key_cap_inside(
    cluster: TeamCluster,
) -> None:
    capped, pooled = cluster.sdk(0, "capped"), cluster.sdk(1, "pooled")

    answers: dict[str, list[str]] = {"capped": [], "pooled": []}
    for _ in range(5):
        answers["capped"].append(_ask(capped))
        answers["pooled"].append(_ask(pooled))

    # The capped key gets its own cap and no more; the other key the rest of
    # the pool, whichever process serves it.
    assert answers["capped"][:CAP] == ["ok"] * CAP
    assert all("budget of this key (" in a for a in answers["capped"][CAP:])
    assert answers["pooled"][: POOL - CAP] == ["ok"] * (POOL - CAP)
    refused = answers["pooled"][POOL - CAP :]
    assert refused and all("budget of this key's team" in a for a in refused)
    # The capped key's later requests are refused by its own cap first.
    assert _ask(cluster.sdk(1, "capped")).startswith("The budget of this key (")
