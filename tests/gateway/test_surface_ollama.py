"""Ollama's native API at Nexus's root, through real processes and the ollama client.

Two mocks serve the module: ``olla`` is an Ollama (its native API is passed
through, body untouched) and ``oa`` an OpenAI-compatible server (Ollama
requests are translated for it). Both have a scripted tool call.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import ollama
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

SHIPS_TO_REDIS = settings.NEXUS_USAGE_TRANSPORT == "redis"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# Served natively by the Ollama mock, translated for the OpenAI one.
NATIVE, TRANSLATED = "llama3:8b", "mistral:7b"


@dataclass
class Gateway:
    server: NexusServer
    olla: MockBackendProcess
    oa: MockBackendProcess
    key: str
    admin_token: str

    def client(self, key: str | None = None, **headers: str) -> ollama.Client:
        return ollama.Client(
            host=self.server.base_url,
            headers={"Authorization": f"Bearer {key or self.key}", **headers},
            timeout=20,
        )

    def upstream(self, mock: MockBackendProcess) -> list[dict[str, Any]]:
        stats = httpx.get(f"{mock.base_url}/_mock/stats", timeout=5).json()
        return [
            r for r in stats["last_requests"] if not r["path"].startswith("/api/ps")
        ]


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, django_db_blocker: Any) -> Iterator[Gateway]:
    olla = start_mock_backend(
        "--kind", "ollama", "--name", "olla", "--models", f"{NATIVE},nomic-embed",
        "--tool-models", NATIVE, "--chunks", "3",
    )  # fmt: skip
    oa = start_mock_backend(
        "--name", "oa", "--models", f"{TRANSLATED},text-embed",
        "--chunks", "3",
    )  # fmt: skip
    with django_db_blocker.unblock():
        if SHIPS_TO_REDIS:
            clear_usage_stream()
        native = Backend.objects.create(
            name="olla",
            base_url=olla.base_url,
            kind="ollama",
            status=HealthStatus.HEALTHY,
        )
        BackendModel.objects.create(
            backend=native,
            name=NATIVE,
            supports_tools=True,
            context_length=8192,
            loaded=True,
        )
        BackendModel.objects.create(backend=native, name="nomic-embed")
        translated = Backend.objects.create(
            name="oa", base_url=oa.base_url, status=HealthStatus.HEALTHY
        )
        BackendModel.objects.create(
            backend=translated,
            name=TRANSLATED,
            supports_tools=True,
            supports_json_mode=True,
            context_length=32768,
        )
        BackendModel.objects.create(backend=translated, name="text-embed")
        _, key = ApiKey.objects.create_key("ollama-tests")
        staff = get_user_model().objects.create_user(
            "ollama-ops", is_staff=True, is_superuser=True
        )
        token = Token.objects.create(user=staff).key
    server = start_nexus_server(NEXUS_BREAKER_FAILURES="1000000")
    try:
        yield Gateway(server, olla, oa, key, token)
    finally:
        server.stop()
        olla.stop()
        oa.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture(autouse=True)
def _reset_mocks(gateway: Gateway) -> Iterator[None]:
    yield
    for mock in (gateway.olla, gateway.oa):
        httpx.post(f"{mock.base_url}/_mock/reset", timeout=5)


def usage_record(request_id: str, django_db_blocker: Any) -> UsageRecord:
    deadline = time.monotonic() + 15
    with django_db_blocker.unblock():
        while True:
            if SHIPS_TO_REDIS:
                drain_usage_stream()
            record = UsageRecord.objects.filter(request_id=request_id).first()
            if record is not None:
                return record
            assert time.monotonic() < deadline, "usage was not recorded"
            time.sleep(0.1)


def request_id() -> str:
    return f"oll-{uuid.uuid4().hex[:8]}"


# The server itself


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_the_gateway_serves_committed_configuration(gateway: Gateway) -> None:
    assert set(Backend.objects.values_list("name", flat=True)) == {"olla", "oa"}


def test_root_and_version_answer_like_ollama(gateway: Gateway) -> None:
    root = httpx.get(gateway.server.base_url + "/", timeout=5)
    assert (root.status_code, root.text) == (200, "Ollama is running")
    version = httpx.get(gateway.server.base_url + "/api/version", timeout=5)
    assert isinstance(version.json()["version"], str)


def test_list_and_ps_show_the_fleets_models(gateway: Gateway) -> None:
    client = gateway.client()
    listed = {model.model for model in client.list().models}
    assert {NATIVE, TRANSLATED, "nomic-embed", "text-embed"} <= listed
    running = {model.model for model in client.ps().models}
    assert {NATIVE, TRANSLATED} <= running


def test_show_reports_capabilities_and_context(gateway: Gateway) -> None:
    shown = gateway.client().show(TRANSLATED)
    assert "tools" in (shown.capabilities or [])
    assert shown.modelinfo is not None
    assert 32768 in shown.modelinfo.values()
    with pytest.raises(ollama.ResponseError) as caught:
        gateway.client().show("gpt-9")
    assert caught.value.status_code == 404


@pytest.mark.parametrize(
    "manage",
    [
        lambda client: client.delete(NATIVE),  # DELETE /api/delete
        lambda client: client.copy(NATIVE, "copied"),  # POST /api/copy
        lambda client: client.pull(NATIVE),  # POST /api/pull
    ],
)
def test_model_management_needs_the_keys_permission_whatever_the_method(
    gateway: Gateway, manage: Callable[[ollama.Client], object]
) -> None:
    # tests/gateway/test_model_management.py covers keys that may.
    with pytest.raises(ollama.ResponseError) as caught:
        manage(gateway.client())
    assert caught.value.status_code == 403
    assert "can_manage_models" in caught.value.error
    assert not {"/api/delete", "/api/copy", "/api/pull"} & {
        r["path"] for r in gateway.upstream(gateway.olla)
    }


def test_management_api_keeps_its_paths(gateway: Gateway) -> None:
    explained = httpx.post(
        f"{gateway.server.base_url}/api/v1/route/explain",
        json={"model": NATIVE},
        headers={"Authorization": f"Token {gateway.admin_token}"},
        timeout=5,
    )
    assert explained.status_code == 200


def test_a_key_is_required(gateway: Gateway) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        gateway.client(key="nx-wrong").chat(
            model=NATIVE, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 401
    anonymous = httpx.get(f"{gateway.server.base_url}/api/tags", timeout=5)
    assert anonymous.status_code == 401
    assert set(anonymous.json()) == {"error"}


# Chat and generate, both ways


@pytest.mark.parametrize(("model", "backend"), [(NATIVE, "olla"), (TRANSLATED, "oa")])
def test_chat_whole_with_usage_from_the_backend(
    gateway: Gateway, django_db_blocker: Any, model: str, backend: str
) -> None:
    rid = request_id()
    reply = gateway.client(**{"X-Request-ID": rid}).chat(
        model=model,
        messages=[
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "why is the sky blue"},
        ],
        options={"temperature": 0.1},
        stream=False,
    )
    assert reply.message.content == f"[{backend}/{model}] echo: why is the sky blue"
    assert (reply.done, reply.done_reason) == (True, "stop")
    assert (reply.prompt_eval_count, reply.eval_count) == (7, 7)
    record = usage_record(rid, django_db_blocker)
    assert (record.backend, record.prompt_tokens, record.completion_tokens) == (
        backend,
        7,
        7,
    )
    assert not record.estimated


def test_the_native_backend_gets_the_body_untouched(gateway: Gateway) -> None:
    body = {
        "model": NATIVE,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "options": {"num_ctx": 2048, "top_k": 5},
        "keep_alive": "10m",
    }
    reply = httpx.post(
        f"{gateway.server.base_url}/api/chat",
        json=body,
        headers={"Authorization": f"Bearer {gateway.key}"},
        timeout=10,
    )
    assert reply.status_code == 200
    (upstream,) = [
        r for r in gateway.upstream(gateway.olla) if r["path"] == "/api/chat"
    ]
    assert json.loads(upstream["body"]) == body
    assert gateway.key not in str(upstream["headers"])


def test_the_openai_backend_gets_a_translated_chat(gateway: Gateway) -> None:
    gateway.client().chat(
        model=TRANSLATED,
        messages=[{"role": "user", "content": "hi"}],
        options={"num_predict": 50, "seed": 3},
        format="json",
        stream=False,
    )
    (upstream,) = [r for r in gateway.upstream(gateway.oa) if "chat" in r["path"]]
    assert upstream["path"] == "/v1/chat/completions"
    sent = json.loads(upstream["body"])
    assert (sent["max_tokens"], sent["seed"]) == (50, 3)
    assert sent["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(("model", "backend"), [(NATIVE, "olla"), (TRANSLATED, "oa")])
def test_chat_streams_ndjson(
    gateway: Gateway, django_db_blocker: Any, model: str, backend: str
) -> None:
    rid = request_id()
    parts = list(
        gateway.client(**{"X-Request-ID": rid}).chat(
            model=model,
            messages=[{"role": "user", "content": "stream it"}],
            stream=True,
        )
    )
    assert [p.done for p in parts] == [False, False, False, True]
    text = "".join(p.message.content or "" for p in parts)
    assert text == f"[{backend}/{model}] echo: stream it"
    last = parts[-1]
    assert (last.prompt_eval_count, last.eval_count) == (2, 4)
    record = usage_record(rid, django_db_blocker)
    assert record.streamed
    assert (record.prompt_tokens, record.completion_tokens) == (2, 4)


@pytest.mark.parametrize(("model", "backend"), [(NATIVE, "olla"), (TRANSLATED, "oa")])
def test_generate_whole_and_streamed(
    gateway: Gateway, model: str, backend: str
) -> None:
    client = gateway.client()
    whole = client.generate(model=model, prompt="tell me", stream=False)
    assert whole.response == f"[{backend}/{model}] echo: tell me"
    assert whole.done
    streamed = list(client.generate(model=model, prompt="tell me", stream=True))
    assert "".join(p.response or "" for p in streamed) == whole.response
    assert streamed[-1].eval_count == whole.eval_count


@pytest.mark.parametrize("model", [NATIVE, TRANSLATED])
@pytest.mark.parametrize("stream", [False, True])
def test_tools_both_ways(gateway: Gateway, model: str, stream: bool) -> None:
    # The mock calls the first tool offered, its string arguments the user's words.
    ask = [{"role": "user", "content": "Paris"}]
    client = gateway.client()
    if stream:
        parts = list(client.chat(model=model, messages=ask, tools=TOOLS, stream=True))
        calls = [c for p in parts for c in (p.message.tool_calls or [])]
    else:
        reply = client.chat(model=model, messages=ask, tools=TOOLS, stream=False)
        calls = list(reply.message.tool_calls or [])
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    answered = client.chat(
        model=model,
        messages=[
            *ask,
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
        ],
        tools=TOOLS,
        stream=False,
    )
    assert answered.message.content.endswith("echo: tool result: sunny")  # type: ignore[union-attr]


def test_generate_options_that_only_ollama_understands_are_refused_elsewhere(
    gateway: Gateway,
) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        gateway.client().generate(model=TRANSLATED, prompt="def f(", suffix="return")
    assert caught.value.status_code == 400
    assert "suffix" in caught.value.error


# Embeddings


@pytest.mark.parametrize("model", ["nomic-embed", "text-embed"])
def test_embed_and_legacy_embeddings(gateway: Gateway, model: str) -> None:
    client = gateway.client()
    embed = client.embed(model=model, input=["a b", "c"])
    assert len(embed.embeddings) == 2
    assert embed.prompt_eval_count == 3
    legacy = client.embeddings(model=model, prompt="a b")
    assert list(legacy.embedding) == pytest.approx(list(embed.embeddings[0]))


# Errors


def test_unknown_models_get_ollamas_error_shape(gateway: Gateway) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        gateway.client().chat(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.status_code == 404
    assert "gpt-9" in caught.value.error


@pytest.mark.parametrize("model", [NATIVE, TRANSLATED])
def test_a_backend_dying_mid_stream_ends_with_an_error_line(
    gateway: Gateway, django_db_blocker: Any, model: str
) -> None:
    for mock in (gateway.olla, gateway.oa):
        httpx.post(
            f"{mock.base_url}/_mock/config",
            json={"drop_after_chunks": 2},
            timeout=5,
        )
    rid = request_id()
    parts = gateway.client(**{"X-Request-ID": rid}).chat(
        model=model, messages=[{"role": "user", "content": "break"}], stream=True
    )
    received = [next(parts), next(parts)]
    with pytest.raises(ollama.ResponseError):
        next(parts)
    assert not any(p.done for p in received)
    assert usage_record(rid, django_db_blocker).is_error
