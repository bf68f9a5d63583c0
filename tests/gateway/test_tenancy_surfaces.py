"""Keys' limits on every inbound surface, each in its own error shape.

One Nexus server (Daphne), an OpenAI-kind, an Anthropic-kind and an
Ollama-kind mock serve the module. Anthropic clients reach the OpenAI mock
translated and the Anthropic mock passed through; OpenAI clients reach the
Anthropic mock translated; Responses clients are always translated; Ollama
clients reach the Ollama mock passed through and the OpenAI mock translated. Every refusal and every budget cut must come in the client's
protocol; a cut stream is billed exactly what its meter counted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import anthropic
import httpx
import ollama
import openai
import pytest
from django.conf import settings
from django.core.management import call_command
from django.utils import timezone

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
UPSTREAM_KEY = "sk-ant-upstream"
CHUNKS = 12
BUDGET_TOKENS = 40
PROMPT = "budget " * 20


@dataclass
class Setup:
    server: NexusServer
    o: MockBackendProcess
    c: MockBackendProcess
    n: MockBackendProcess
    keys: dict[str, str]

    def anthropic(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.server.base_url, api_key=self.keys[key], max_retries=0
        )

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.server.base_url}/v1",
            api_key=self.keys[key],
            max_retries=0,
        )

    def ollama(self, key: str) -> ollama.Client:
        return ollama.Client(
            host=self.server.base_url,
            headers={"Authorization": f"Bearer {self.keys[key]}"},
            timeout=20,
        )

    def post(self, key: str, path: str, body: dict) -> httpx.Response:
        return httpx.post(
            f"{self.server.base_url}{path}",
            json=body,
            headers={"authorization": f"Bearer {self.keys[key]}"},
            timeout=10,
        )

    def messages(self, key: str, body: dict) -> httpx.Response:
        return httpx.post(
            f"{self.server.base_url}/v1/messages",
            json=body,
            headers={"x-api-key": self.keys[key], "anthropic-version": "2023-06-01"},
            timeout=10,
        )


_blocker = None


def _record(request_id: str, limit: float = 20.0) -> UsageRecord:
    """Wait for one request's usage row (read outside any test transaction)."""
    assert _blocker is not None
    deadline = time.monotonic() + limit
    while True:
        with _blocker.unblock():
            if SHIPS_TO_REDIS:
                drain_usage_stream()
            record = UsageRecord.objects.filter(request_id=request_id).first()
        if record is not None:
            return record
        assert time.monotonic() < deadline, request_id
        time.sleep(0.1)


@pytest.fixture(scope="module")
def setup(django_db_setup: None, django_db_blocker) -> Iterator[Setup]:
    global _blocker
    _blocker = django_db_blocker
    started: list[MockBackendProcess] = []
    server = None
    try:
        o = start_mock_backend(
            "--models", "llama3:8b,mistral:7b", "--name", "ten-o", "--chunks",
            str(CHUNKS),
        )  # fmt: skip
        started.append(o)
        c = start_mock_backend(
            "--models", "claude-x", "--name", "ten-c", "--kind", "anthropic",
            "--api-key", UPSTREAM_KEY, "--chunks", str(CHUNKS),
        )  # fmt: skip
        started.append(c)
        n = start_mock_backend(
            "--models", "qwen:1b", "--name", "ten-n", "--kind", "ollama",
            "--chunks", str(CHUNKS),
        )  # fmt: skip
        started.append(n)
        with django_db_blocker.unblock():
            if SHIPS_TO_REDIS:
                clear_usage_stream()
            backend_o = Backend.objects.create(
                name="ten-o", base_url=o.base_url, status=HealthStatus.HEALTHY
            )
            for name in ("llama3:8b", "mistral:7b"):
                BackendModel.objects.create(backend=backend_o, name=name)
            backend_c = Backend.objects.create(
                name="ten-c",
                base_url=c.base_url,
                kind="anthropic",
                api_key=UPSTREAM_KEY,
                status=HealthStatus.HEALTHY,
            )
            BackendModel.objects.create(backend=backend_c, name="claude-x")
            backend_n = Backend.objects.create(
                name="ten-n",
                base_url=n.base_url,
                kind="ollama",
                status=HealthStatus.HEALTHY,
            )
            BackendModel.objects.create(backend=backend_n, name="qwen:1b")
            day = {"budget_period": "day"}
            specs = {
                "listed": {"allowed_models": "llama3:*,claude-x"},
                "expired": {"expires_at": timezone.now() - timedelta(minutes=1)},
                "rpm": {"rpm_limit": 2},
                "budget-t": {"budget_tokens": BUDGET_TOKENS, **day},
                "budget-p": {"budget_tokens": BUDGET_TOKENS, **day},
                "budget-o": {"budget_tokens": BUDGET_TOKENS, **day},
                "budget-r": {"budget_tokens": BUDGET_TOKENS, **day},
                "budget-n": {"budget_tokens": BUDGET_TOKENS, **day},
                "budget-nt": {"budget_tokens": BUDGET_TOKENS, **day},
            }
            keys = {
                name: ApiKey.objects.create_key(f"surfaces-{name}", **limits)[1]
                for name, limits in specs.items()
            }
        server = start_nexus_server(NEXUS_BREAKER_FAILURES="1000000")
        yield Setup(server, o, c, n, keys)
    finally:
        if server is not None:
            server.stop()
        for process in started:
            process.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_the_keys_are_committed(setup: Setup) -> None:
    assert ApiKey.objects.filter(name__startswith="surfaces-").count() == len(
        setup.keys
    )


def test_an_expired_key_gets_anthropics_authentication_error(setup: Setup) -> None:
    with pytest.raises(anthropic.AuthenticationError) as refused:
        setup.anthropic("expired").messages.create(
            model="llama3:8b", max_tokens=5, messages=user("hi")
        )
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert "expired" in refused.value.body["error"]["message"]


def test_the_allow_list_holds_on_messages_and_count_tokens(setup: Setup) -> None:
    client = setup.anthropic("listed")
    # Allowed, translated and passed through.
    assert client.messages.create(model="llama3:8b", max_tokens=5, messages=user("a"))
    assert client.messages.create(model="claude-x", max_tokens=5, messages=user("a"))
    for model in ("mistral:7b", "no-such-model"):
        with pytest.raises(anthropic.PermissionDeniedError) as refused:
            client.messages.create(model=model, max_tokens=5, messages=user("a"))
        assert refused.value.body["error"]["type"] == "permission_error"
        assert "not allowed" in refused.value.body["error"]["message"]
        with pytest.raises(anthropic.PermissionDeniedError):
            client.messages.count_tokens(model=model, messages=user("a"))
    counted = client.messages.count_tokens(model="llama3:8b", messages=user("a"))
    assert counted.input_tokens > 0


def test_rpm_gives_anthropics_rate_limit_error_with_the_headers(
    setup: Setup,
) -> None:
    body = {"model": "llama3:8b", "max_tokens": 5, "messages": user("hi")}
    answers = [setup.messages("rpm", body) for _ in range(3)]

    assert [a.status_code for a in answers] == [200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:2]] == [
        "1",
        "0",
    ]
    refused = answers[2]
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "2"


def _anthropic_events(text: str) -> list[dict]:
    return [
        json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")
    ]


@pytest.mark.parametrize(
    ("key", "model"),
    [("budget-t", "llama3:8b"), ("budget-p", "claude-x")],
    ids=["translated", "passed-through"],
)
def test_an_anthropic_stream_is_cut_where_the_budget_ran_out(
    setup: Setup, key: str, model: str
) -> None:
    answer = setup.messages(
        key,
        {"model": model, "max_tokens": 500, "stream": True, "messages": user(PROMPT)},
    )
    assert answer.status_code == 200
    events = _anthropic_events(answer.text)
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["type"] == "rate_limit_error"
    assert "budget" in events[-1]["error"]["message"]
    assert not any(e["type"] == "message_stop" for e in events)
    texts = [
        e["delta"]["text"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    ]
    assert 0 < len(texts) < CHUNKS

    record = _record(answer.headers["x-request-id"])
    assert record.error == "budget_exceeded" and record.estimated
    prompt = record.prompt_tokens
    # Cut right after the event that took the count past the budget, and
    # billed exactly that count.
    relayed = sum(len(text) for text in texts)
    before = relayed - len(texts[-1])
    assert prompt + -(-before // 4) <= BUDGET_TOKENS < prompt + -(-relayed // 4)
    assert record.completion_tokens == -(-relayed // 4)

    refused = setup.messages(
        key, {"model": model, "max_tokens": 5, "messages": user("x")}
    )
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"


def test_an_openai_stream_from_an_anthropic_backend_is_cut_in_openais_shape(
    setup: Setup,
) -> None:
    raw = setup.openai("budget-o").chat.completions.with_raw_response.create(
        model="claude-x", messages=user(PROMPT), stream=True
    )
    request_id = raw.headers["x-request-id"]
    texts: list[str] = []
    with pytest.raises(openai.APIError) as cut:
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                texts.append(chunk.choices[0].delta.content)
    assert "budget" in cut.value.message
    assert 0 < len(texts) < CHUNKS

    record = _record(request_id)
    assert record.error == "budget_exceeded"
    relayed = sum(len(text) for text in texts)
    before = relayed - len(texts[-1])
    prompt = record.prompt_tokens
    assert prompt + -(-before // 4) <= BUDGET_TOKENS < prompt + -(-relayed // 4)
    assert record.completion_tokens == -(-relayed // 4)


# --- Responses ---------------------------------------------------------------


def test_responses_follow_the_allow_list_and_expiry(setup: Setup) -> None:
    listed = setup.openai("listed")
    assert listed.responses.create(model="llama3:8b", input="hi").output_text
    with pytest.raises(openai.PermissionDeniedError) as refused:
        listed.responses.create(model="mistral:7b", input="hi")
    assert refused.value.code == "model_not_allowed"
    with pytest.raises(openai.AuthenticationError) as expired:
        setup.openai("expired").responses.create(model="llama3:8b", input="hi")
    assert expired.value.code == "key_expired"


def test_a_responses_stream_is_cut_with_a_budget_error_event(setup: Setup) -> None:
    answer = setup.post(
        "budget-r",
        "/v1/responses",
        {"model": "llama3:8b", "input": PROMPT, "stream": True},
    )
    assert answer.status_code == 200
    events = [
        json.loads(line[6:])
        for line in answer.text.splitlines()
        if line.startswith("data: ")
    ]
    kinds = [event["type"] for event in events]
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "budget_exceeded"
    assert events[-1]["response"]["error"]["code"] == "budget_exceeded"
    assert "response.completed" not in kinds
    texts = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert 0 < len(texts) < CHUNKS

    record = _record(answer.headers["x-request-id"])
    assert record.error == "budget_exceeded"
    relayed = sum(len(text) for text in texts)
    before = relayed - len(texts[-1])
    prompt = record.prompt_tokens
    assert prompt + -(-before // 4) <= BUDGET_TOKENS < prompt + -(-relayed // 4)
    assert record.completion_tokens == -(-relayed // 4)


# --- Ollama --------------------------------------------------------------------


def test_ollamas_catalogue_and_chat_follow_the_allow_list(setup: Setup) -> None:
    listed = setup.ollama("listed")
    assert sorted(m.model for m in listed.list().models) == ["claude-x", "llama3:8b"]
    assert {m.model for m in listed.ps().models} <= {"claude-x", "llama3:8b"}
    assert {m.model for m in setup.ollama("budget-n").list().models} == {
        "llama3:8b",
        "mistral:7b",
        "claude-x",
        "qwen:1b",
    }
    with pytest.raises(ollama.ResponseError) as hidden:
        listed.show("qwen:1b")
    assert hidden.value.status_code == 404
    assert listed.show("llama3:8b")
    for model in ("qwen:1b", "no-such-model"):
        with pytest.raises(ollama.ResponseError) as refused:
            listed.chat(model=model, messages=user("x"))
        assert refused.value.status_code == 403
        assert "not allowed" in refused.value.error
    # A load-only request names a model too.
    refused_load = setup.post("listed", "/api/generate", {"model": "qwen:1b"})
    assert refused_load.status_code == 403
    with pytest.raises(ollama.ResponseError) as expired:
        setup.ollama("expired").list()
    assert expired.value.status_code == 401


@pytest.mark.parametrize(
    ("key", "model"),
    [("budget-n", "qwen:1b"), ("budget-nt", "llama3:8b")],
    ids=["passed-through", "translated"],
)
def test_an_ollama_stream_is_cut_with_an_error_line(
    setup: Setup, key: str, model: str
) -> None:
    answer = setup.post(
        key,
        "/api/chat",
        {"model": model, "messages": user(PROMPT), "stream": True},
    )
    assert answer.status_code == 200
    lines = [json.loads(line) for line in answer.text.splitlines() if line]
    assert "budget" in lines[-1]["error"]
    chunks = lines[:-1]
    assert not any(line.get("done") for line in chunks)
    texts = [line["message"]["content"] for line in chunks]
    texts = [text for text in texts if text]
    assert 0 < len(texts) < CHUNKS

    record = _record(answer.headers["x-request-id"])
    assert record.error == "budget_exceeded"
    relayed = sum(len(text) for text in texts)
    before = relayed - len(texts[-1])
    prompt = record.prompt_tokens
    assert prompt + -(-before // 4) <= BUDGET_TOKENS < prompt + -(-relayed // 4)
    assert record.completion_tokens == -(-relayed // 4)
