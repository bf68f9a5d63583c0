"""Claude Code through Nexus: its default model ids reach local models through
pattern aliases, with Claude Code's own request shapes.

The requests in tests/fixtures/claude_code/ are written as Claude Code 2.x
sends them (``?beta=true``, ``anthropic-beta`` flags, ``thinking``,
``context_management``, ``cache_control``, tools whose schemas carry
``$schema``). They are replayed as they are, and sent again with the official
``anthropic`` client's beta API (which Claude Code is built on), against one
Nexus (Daphne) with two mock backends that do not speak Anthropic's API:
``mock-o`` (kind openai, llama3:8b) behind ``claude-*`` and ``mock-l`` (kind
ollama, qwen2.5:0.5b) behind the longer ``claude-haiku-*``; ``mock-c`` (kind
anthropic, claude-x) behind ``claude-opus-*`` gets the body passed through.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import Alias, FallbackChain, RoutingPolicy
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey

FIXTURES = Path(__file__).parent.parent / "fixtures" / "claude_code"
REQUESTS = sorted(FIXTURES.glob("*.json"))
# What Claude Code sends that an OpenAI-style backend must never see.
ANTHROPIC_ONLY = ("cache_control", "thinking", "context_management", "$schema")
# Fields of an OpenAI chat request that the translation may write.
CHAT_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "stop",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "user",
}
STREAM_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "ping",
}


@dataclass
class Gateway:
    server: NexusServer
    o: MockBackendProcess  # kind openai: llama3:8b, behind claude-*
    ollama: MockBackendProcess  # kind ollama: qwen2.5:0.5b, behind claude-haiku-*
    c: MockBackendProcess  # kind anthropic: claude-x, behind claude-opus-*
    key: str
    llama_only: str  # a key allowed llama3:*
    claude_names: str  # a key allowed claude-*

    def client(self, key: str | None = None) -> anthropic.Anthropic:
        # Claude Code's set-up: ANTHROPIC_BASE_URL is the server's root.
        return anthropic.Anthropic(
            base_url=self.server.base_url, api_key=key or self.key, max_retries=0
        )


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _last_request(process: MockBackendProcess) -> dict[str, Any]:
    stats = httpx.get(f"{process.base_url}/_mock/stats", timeout=5).json()
    return stats["last_requests"][-1]


def _requests_seen(process: MockBackendProcess) -> int:
    stats = httpx.get(f"{process.base_url}/_mock/stats", timeout=5).json()
    return len(stats["last_requests"])


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, django_db_blocker) -> Iterator[Gateway]:
    with contextlib.ExitStack() as cleanup:
        o = start_mock_backend("--models", "llama3:8b", "--name", "mock-o")
        cleanup.callback(o.stop)
        ollama = start_mock_backend(
            "--kind", "ollama", "--models", "qwen2.5:0.5b", "--name", "mock-l"
        )
        cleanup.callback(ollama.stop)
        c = start_mock_backend(
            "--kind", "anthropic", "--models", "claude-x", "--name", "mock-c"
        )
        cleanup.callback(c.stop)

        def flush() -> None:
            with django_db_blocker.unblock():
                call_command("flush", interactive=False, verbosity=0)

        cleanup.callback(flush)
        with django_db_blocker.unblock():
            backend_o = Backend.objects.create(
                name="mock-o", base_url=o.base_url, status=HealthStatus.HEALTHY
            )
            BackendModel.objects.create(
                backend=backend_o, name="llama3:8b", supports_tools=True
            )
            backend_l = Backend.objects.create(
                name="mock-l",
                base_url=ollama.base_url,
                kind="ollama",
                status=HealthStatus.HEALTHY,
            )
            BackendModel.objects.create(
                backend=backend_l, name="qwen2.5:0.5b", discovered=True
            )
            backend_c = Backend.objects.create(
                name="mock-c",
                base_url=c.base_url,
                kind="anthropic",
                status=HealthStatus.HEALTHY,
            )
            BackendModel.objects.create(
                backend=backend_c, name="claude-x", supports_tools=True
            )
            Alias.objects.create(name="claude-*", target="llama3:8b")
            Alias.objects.create(name="claude-opus-*", target="claude-x")
            Alias.objects.create(name="claude-haiku-*", target="qwen2.5:0.5b")
            # gpt-4 serves only through its fallback chain.
            Alias.objects.create(name="gpt-4", target="llama3:70b")
            FallbackChain.objects.create(model="gpt-4").set_fallbacks(["llama3:8b"])
            policy = RoutingPolicy.load()
            policy.max_retries = 0
            policy.save()
            _, key = ApiKey.objects.create_key("claude-code")
            _, llama_only = ApiKey.objects.create_key(
                "llama-only", allowed_models="llama3:*"
            )
            _, claude_names = ApiKey.objects.create_key(
                "claude", allowed_models="claude-*"
            )
        server = start_nexus_server(NEXUS_BREAKER_FAILURES="1000000")
        cleanup.callback(server.stop)
        yield Gateway(server, o, ollama, c, key, llama_only, claude_names)


def _backend_for(gateway: Gateway, model: str) -> MockBackendProcess:
    return gateway.ollama if model.startswith("claude-haiku-") else gateway.o


def _served(model: str) -> str:
    # A Message names the model that answered (as for any alias).
    return "qwen2.5:0.5b" if model.startswith("claude-haiku-") else "llama3:8b"


def _assert_nothing_anthropic_only_reached(process: MockBackendProcess) -> None:
    sent = _last_request(process)
    body = json.loads(sent["body"])
    assert set(body) <= CHAT_FIELDS, set(body) - CHAT_FIELDS
    text = json.dumps(body)
    assert not [word for word in ANTHROPIC_ONLY if f'"{word}"' in text]
    assert "anthropic-beta" not in {name.lower() for name in sent["headers"]}


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    """The stream's events, each checked against its `event:` line."""
    events = []
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == name
            events.append(data)
    return events


@pytest.mark.parametrize("path", REQUESTS, ids=[p.stem for p in REQUESTS])
def test_claude_codes_requests_as_sent_get_valid_anthropic_answers(
    gateway: Gateway, path: Path
) -> None:
    recorded = _load(path)
    body = recorded["body"]
    model = body["model"]
    backend = _backend_for(gateway, model)
    before = _requests_seen(backend)
    headers = recorded["headers"] | {"x-api-key": gateway.key}
    url = gateway.server.base_url + recorded["path"]
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
        response.read()
    assert response.status_code == 200, response.text

    if recorded["path"].startswith("/v1/messages/count_tokens"):
        counted = response.json()
        assert set(counted) == {"input_tokens"}
        assert counted["input_tokens"] > 100  # the tools' schemas count
        assert _requests_seen(backend) == before  # estimated, nothing sent
        return

    assert response.headers["x-nexus-backend"] == (
        "mock-l" if backend is gateway.ollama else "mock-o"
    )
    if body.get("stream"):
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
        types = [event["type"] for event in events]
        assert set(types) <= STREAM_EVENTS
        assert types[0] == "message_start" and types[-1] == "message_stop"
        assert events[0]["message"]["model"] == _served(model)
        assert "message_delta" in types
    else:
        message = response.json()
        assert message["type"] == "message" and message["role"] == "assistant"
        assert message["model"] == _served(model)
        assert message["stop_reason"] in ("end_turn", "max_tokens")
    _assert_nothing_anthropic_only_reached(backend)


def test_the_official_clients_beta_api_streams_the_main_turn(gateway: Gateway) -> None:
    recorded = _load(FIXTURES / "01_main_turn_stream.json")
    body = dict(recorded["body"])
    del body["stream"]
    extra = {"context_management": body.pop("context_management")}
    betas = recorded["headers"]["anthropic-beta"].split(",")
    client = gateway.client()
    # What this SDK release's stream() does not name (anthropic 2.x dropped
    # `temperature` there) goes as it would on the wire.
    named = inspect.signature(client.beta.messages.stream).parameters
    extra |= {name: body.pop(name) for name in list(body) if name not in named}
    with client.beta.messages.stream(**body, betas=betas, extra_body=extra) as stream:
        message = stream.get_final_message()
    assert message.model == "llama3:8b"
    assert message.content, "an answer with content"
    assert message.stop_reason in ("end_turn", "tool_use", "max_tokens")
    assert message.usage.output_tokens > 0
    _assert_nothing_anthropic_only_reached(gateway.o)


def test_the_official_clients_beta_api_for_haiku_and_count_tokens(
    gateway: Gateway,
) -> None:
    client = gateway.client()
    quota = _load(FIXTURES / "04_quota_check.json")["body"]
    message = client.beta.messages.create(**quota, betas=["claude-code-20250219"])
    assert message.model == "qwen2.5:0.5b"
    assert message.stop_reason == "max_tokens"
    assert _last_request(gateway.ollama)["body"]

    counting = _load(FIXTURES / "05_count_tokens.json")["body"]
    counted = client.beta.messages.count_tokens(
        **counting, betas=["token-counting-2024-11-01"]
    )
    assert counted.input_tokens > 100


def test_a_key_is_judged_by_the_name_asked_for_or_the_model_it_resolves_to(
    gateway: Gateway,
) -> None:
    llama_only, claude_names = gateway.llama_only, gateway.claude_names
    request = {
        "model": "claude-sonnet-4-6",
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "hi"}],
    }
    # By the model the pattern resolves to ...
    assert gateway.client(llama_only).messages.create(**request).content
    # ... or by the name asked for, matched by the key's own globs.
    assert gateway.client(claude_names).messages.create(**request).content
    with pytest.raises(anthropic.PermissionDeniedError) as refused:
        gateway.client(llama_only).messages.create(
            **request | {"model": "claude-haiku-4-5-20251001"}
        )
    assert refused.value.body["error"]["type"] == "permission_error"


def test_patterns_are_not_models_but_an_alias_served_by_its_chain_is(
    gateway: Gateway,
) -> None:
    listed = openai.OpenAI(
        base_url=f"{gateway.server.base_url}/v1", api_key=gateway.key, max_retries=0
    ).models.list()
    owners = {model.id: model.owned_by for model in listed}
    assert owners == {
        "gpt-4": "alias:llama3:70b",
        "claude-x": "mock-c",
        "llama3:8b": "mock-o",
        "qwen2.5:0.5b": "mock-l",
    }
    anthropic_ids = [m.id for m in gateway.client().models.list()]
    assert anthropic_ids == ["claude-x", "gpt-4", "llama3:8b", "qwen2.5:0.5b"]


def test_a_name_no_pattern_covers_is_still_an_anthropic_404(gateway: Gateway) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        gateway.client().messages.create(
            model="gpt-5", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_an_anthropic_backend_behind_a_pattern_gets_claude_codes_body_whole(
    gateway: Gateway,
) -> None:
    recorded = _load(FIXTURES / "01_main_turn_stream.json")
    body = recorded["body"] | {"model": "claude-opus-4-1-20250805"}
    headers = recorded["headers"] | {"x-api-key": gateway.key}
    with httpx.stream(
        "POST",
        gateway.server.base_url + recorded["path"],
        json=body,
        headers=headers,
        timeout=30,
    ) as response:
        events = _events(response)
    assert response.status_code == 200
    assert response.headers["x-nexus-backend"] == "mock-c"
    assert events[0]["type"] == "message_start" and events[-1]["type"] == (
        "message_stop"
    )
    sent = _last_request(gateway.c)
    passed = json.loads(sent["body"])
    # Passed through, with the model the pattern names; nothing dropped.
    assert passed == body | {"model": "claude-x"}
    assert sent["headers"]["anthropic-beta"] == recorded["headers"]["anthropic-beta"]
