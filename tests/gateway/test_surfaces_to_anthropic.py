"""Responses and Ollama clients served by an Anthropic backend (translated twice).

The canonical form sits between: Responses or Ollama -> chat completions ->
Anthropic Messages, and back. One Nexus server and one Anthropic-kind mock
serve the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import ollama
import openai
import pytest
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey

UPSTREAM_KEY = "sk-ant-upstream"
MODEL = "claude-x"


@dataclass
class Gateway:
    server: NexusServer
    mock: MockBackendProcess
    key: str

    def last_upstream(self) -> dict[str, Any]:
        stats = httpx.get(f"{self.mock.base_url}/_mock/stats", timeout=5).json()
        last: dict[str, Any] = stats["last_requests"][-1]
        return last


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, django_db_blocker: Any) -> Iterator[Gateway]:
    mock = start_mock_backend(
        "--models", MODEL, "--name", "mock-c", "--kind", "anthropic",
        "--api-key", UPSTREAM_KEY, "--chunks", "3",
    )  # fmt: skip
    with django_db_blocker.unblock():
        backend = Backend.objects.create(
            name="mock-c",
            base_url=mock.base_url,
            kind="anthropic",
            api_key=UPSTREAM_KEY,
            status=HealthStatus.HEALTHY,
        )
        BackendModel.objects.create(backend=backend, name=MODEL, supports_tools=True)
        _, key = ApiKey.objects.create_key("to-anthropic-tests")
    server = start_nexus_server(NEXUS_BREAKER_FAILURES="1000000")
    try:
        yield Gateway(server, mock, key)
    finally:
        server.stop()
        mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_the_gateway_serves_committed_configuration(gateway: Gateway) -> None:
    assert Backend.objects.filter(kind="anthropic").count() == 1


def test_a_responses_client_gets_an_anthropic_backends_answer(
    gateway: Gateway,
) -> None:
    sdk = openai.OpenAI(
        base_url=f"{gateway.server.base_url}/v1", api_key=gateway.key, max_retries=0
    )
    response = sdk.responses.create(model=MODEL, input="hello there")
    assert response.output_text == f"[mock-c/{MODEL}] echo: hello there"
    assert response.usage is not None and response.usage.output_tokens > 0
    upstream = gateway.last_upstream()
    assert upstream["path"] == "/v1/messages"
    assert upstream["headers"]["x-api-key"] == UPSTREAM_KEY
    events = list(sdk.responses.create(model=MODEL, input="stream it", stream=True))
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == f"[mock-c/{MODEL}] echo: stream it"


def test_an_ollama_client_gets_an_anthropic_backends_answer(
    gateway: Gateway,
) -> None:
    client = ollama.Client(
        host=gateway.server.base_url,
        headers={"Authorization": f"Bearer {gateway.key}"},
        timeout=20,
    )
    ask = [{"role": "user", "content": "hello there"}]
    reply = client.chat(model=MODEL, messages=ask, stream=False)
    assert reply.message.content == f"[mock-c/{MODEL}] echo: hello there"
    assert reply.prompt_eval_count and reply.eval_count
    assert gateway.last_upstream()["path"] == "/v1/messages"
    parts = list(client.chat(model=MODEL, messages=ask, stream=True))
    assert parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == reply.message.content
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model=MODEL, input="no embeddings here")
    assert caught.value.status_code == 501
