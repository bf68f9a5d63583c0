"""Context shift through real processes: mocks that enforce their context.

Each mock imitates one kind of server (llama.cpp, Ollama, vLLM, an
OpenAI-compatible one) with a context of ``CONTEXT`` tokens (the mock counts
words) and answers a longer chat with that server's own overflow error
(nexus_mock.overflow). Nexus trims the chat and resends it to the same
backend; the client, through the official openai and anthropic SDKs, sees one
answer and ``x-nexus-context-shift``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from django.conf import settings
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    mock_stats,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

SHIPS_TO_REDIS = settings.NEXUS_USAGE_TRANSPORT == "redis"

CONTEXT = 400
KINDS = ("llamacpp", "ollama", "vllm", "openai")
# Each kind's model: llama.cpp's is served to the Anthropic client too.
MODELS = {kind: f"{kind}-small" for kind in KINDS}
# Servers whose overflow gives its numbers (Ollama's does not).
COUNTING = ("llamacpp", "vllm", "openai")
# An Ollama model whose context Nexus knows (discovered or configured).
KNOWN = "ollama-known"
# One model per test on top: a model's overflow is remembered by the gateway
# (pre-trimming), which would change the next test's first request.
EXTRA = {
    "llamacpp": ("lc-tools", "lc-single", "lc-anthropic", "lc-stream", "lc-ollama"),
    "vllm": ("vllm-pre",),
    "ollama": (KNOWN,),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up. " + "Very long schema text. " * 120,
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


@dataclass
class Gateway:
    server: NexusServer
    mocks: dict[str, MockBackendProcess]
    key: str

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.server.base_url + "/v1",
            api_key=self.key,
            timeout=20,
            max_retries=0,
        )

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.server.base_url, api_key=self.key, timeout=20, max_retries=0
        )

    def seen(self, kind: str) -> list[dict[str, Any]]:
        """The chat bodies the kind's mock received, oldest first."""
        return [
            json.loads(r["body"])
            for r in mock_stats(self.mocks[kind])["last_requests"]
            if r["path"] in ("/v1/chat/completions", "/api/chat")
        ]


def _start_mock(kind: str) -> MockBackendProcess:
    names = ",".join((MODELS[kind], *EXTRA.get(kind, ())))
    return start_mock_backend(
        "--kind", kind, "--name", kind, "--models", names,
        "--context-length", str(CONTEXT), "--enforce-context", "--tool-models", names,
    )  # fmt: skip


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, django_db_blocker: Any) -> Iterator[Gateway]:
    mocks = {kind: _start_mock(kind) for kind in KINDS}
    try:
        with django_db_blocker.unblock():
            if SHIPS_TO_REDIS:
                clear_usage_stream()
            for kind, mock in mocks.items():
                backend = Backend.objects.create(
                    name=kind,
                    base_url=mock.base_url,
                    kind=kind,
                    status=HealthStatus.HEALTHY,
                )
                # Context unknown to Nexus: only the server's error tells it.
                for name in (MODELS[kind], *EXTRA.get(kind, ())):
                    BackendModel.objects.create(
                        backend=backend,
                        name=name,
                        supports_tools=True,
                        loaded=True,
                        context_length=CONTEXT if name == KNOWN else None,
                    )
            _, key = ApiKey.objects.create_key("context-shift-tests")
        server = start_nexus_server(NEXUS_BREAKER_FAILURES="1000000")
        try:
            yield Gateway(server, mocks, key)
        finally:
            server.stop()
    finally:
        for mock in mocks.values():
            mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture(autouse=True)
def _reset_mocks(gateway: Gateway) -> Iterator[None]:
    yield
    for mock in gateway.mocks.values():
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


def long_chat(turns: int = 40, tag: str = "") -> list[dict[str, Any]]:
    """A system prompt and ``turns`` alternating user and assistant messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for index in range(turns):
        role = "user" if index % 2 == 0 else "assistant"
        words = " ".join(f"word{n}" for n in range(20))
        messages.append({"role": role, "content": f"{tag}turn {index}: {words}"})
    messages.append({"role": "user", "content": f"{tag}the newest question"})
    return messages


def dropped_of(headers: Any) -> int:
    value = headers.get("x-nexus-context-shift", "")
    assert value.startswith("dropped="), value
    return int(value.split(";")[0].removeprefix("dropped="))


@pytest.mark.parametrize("kind", COUNTING)
def test_a_long_chat_succeeds_after_one_trimmed_retry(
    gateway: Gateway, kind: str, django_db_blocker: Any
) -> None:
    messages = long_chat(tag=f"{kind} ")
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=MODELS[kind], messages=messages
    )
    reply = raw.parse()
    assert "the newest question" in (reply.choices[0].message.content or "")
    dropped = dropped_of(raw.headers)
    assert dropped > 0
    assert mock_stats(gateway.mocks[kind])["context_overflows"] == 1
    first, retried = gateway.seen(kind)
    assert len(first["messages"]) == len(messages)
    kept = retried["messages"]
    assert len(kept) == len(messages) - dropped
    assert kept[0] == messages[0]  # the system prompt
    assert kept[-1] == messages[-1]  # the newest message
    assert kept[1]["role"] == "user"
    # The oldest went first: what is kept is the tail of the chat.
    assert kept[1:] == messages[len(messages) - len(kept) + 1 :]
    # Usage: the successful attempt's tokens (the mock counts words), one trim.
    record = usage_record(raw.headers["x-request-id"], django_db_blocker)
    assert record.prompt_tokens == sum(len(m["content"].split()) for m in kept)
    assert record.context_shifts == 1
    assert record.status == 200


def test_an_anthropic_client_gets_its_answer_from_a_small_llamacpp(
    gateway: Gateway,
) -> None:
    chat = long_chat(tag="anthropic ")
    raw = gateway.anthropic().messages.with_raw_response.create(
        model="lc-anthropic",
        max_tokens=50,
        system=chat[0]["content"],
        messages=chat[1:],
    )
    message = raw.parse()
    assert message.type == "message"
    assert "the newest question" in message.content[0].text  # type: ignore[union-attr]
    assert dropped_of(raw.headers) > 0
    assert mock_stats(gateway.mocks["llamacpp"])["context_overflows"] == 1


def test_tools_are_dropped_on_the_second_retry_when_they_overflow(
    gateway: Gateway,
) -> None:
    messages = long_chat(turns=4, tag="tools ")
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="lc-tools", messages=messages, tools=TOOLS
    )
    assert raw.parse().choices[0].message is not None
    assert "tools=dropped" in raw.headers["x-nexus-context-shift"]
    assert mock_stats(gateway.mocks["llamacpp"])["context_overflows"] == 2
    first, retry1, retry2 = gateway.seen("llamacpp")
    assert first["tools"] and retry1["tools"]  # retry 1 keeps the tools
    assert "tools" not in retry2
    assert retry2["messages"][-1] == messages[-1]


def test_a_single_message_over_the_limit_fails_with_the_servers_error(
    gateway: Gateway,
) -> None:
    huge = " ".join(f"w{n}" for n in range(CONTEXT * 2))
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(
            model="lc-single",
            messages=[
                {"role": "system", "content": "s"},
                {"role": "user", "content": huge},
            ],
        )
    assert "exceeds the available context size" in str(caught.value)
    assert "x-nexus-context-shift" not in caught.value.response.headers
    with pytest.raises(anthropic.BadRequestError) as refused:
        gateway.anthropic().messages.create(
            model="lc-single",
            max_tokens=50,
            messages=[{"role": "user", "content": huge}],
        )
    body = refused.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "context size" in body["error"]["message"]


def test_after_an_overflow_the_next_long_chat_is_trimmed_before_sending(
    gateway: Gateway,
) -> None:
    client = gateway.openai()
    model = "vllm-pre"
    client.chat.completions.create(model=model, messages=long_chat(tag="one "))
    assert mock_stats(gateway.mocks["vllm"])["context_overflows"] == 1
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=long_chat(tag="two ")
    )
    assert "two the newest question" in (raw.parse().choices[0].message.content or "")
    assert dropped_of(raw.headers) > 0
    assert mock_stats(gateway.mocks["vllm"])["context_overflows"] == 1


def test_ollama_without_numbers_halves_until_it_fits(gateway: Gateway) -> None:
    """Ollama's overflow says no numbers and the context is not known: each
    retry halves the chat, within the two retries."""
    messages = long_chat(tag="halves ")
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=MODELS["ollama"], messages=messages
    )
    assert "halves the newest question" in (
        raw.parse().choices[0].message.content or ""
    )
    assert dropped_of(raw.headers) > 0
    overflows = mock_stats(gateway.mocks["ollama"])["context_overflows"]
    assert 1 <= overflows <= 2
    *_, last = gateway.seen("ollama")
    assert last["messages"][0] == messages[0]
    assert last["messages"][-1] == messages[-1]


def test_a_chat_longer_than_the_known_context_is_trimmed_and_routed(
    gateway: Gateway,
) -> None:
    """The router would answer 400 (longer than every candidate's context):
    context shift trims it to fit instead, and the server never overflows."""
    messages = long_chat(tag="known ")
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=KNOWN, messages=messages
    )
    assert "known the newest question" in (raw.parse().choices[0].message.content or "")
    dropped = dropped_of(raw.headers)
    assert dropped > 0
    assert mock_stats(gateway.mocks["ollama"])["context_overflows"] == 0
    (sent,) = gateway.seen("ollama")
    assert len(sent["messages"]) == len(messages) - dropped
    assert sent["messages"][-1] == messages[-1]


def test_the_routers_400_stays_when_nothing_may_be_dropped(gateway: Gateway) -> None:
    huge = " ".join(f"w{n}" for n in range(CONTEXT * 4))
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(
            model=KNOWN, messages=[{"role": "user", "content": huge}]
        )
    assert caught.value.code == "capability_mismatch"
    assert gateway.seen("ollama") == []


def test_a_streamed_answer_comes_after_the_trimmed_retry(gateway: Gateway) -> None:
    messages = long_chat(tag="stream ")
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="lc-stream", messages=messages, stream=True
    )
    assert dropped_of(raw.headers) > 0
    text = "".join(
        chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices
    )
    assert "stream the newest question" in text
    assert mock_stats(gateway.mocks["llamacpp"])["context_overflows"] == 1


def test_an_ollama_client_gets_its_answer_from_a_small_llamacpp(
    gateway: Gateway,
) -> None:
    client = ollama.Client(
        host=gateway.server.base_url,
        headers={"Authorization": f"Bearer {gateway.key}"},
        timeout=20,
    )
    messages = long_chat(tag="ollama-client ")
    reply = client.chat(model="lc-ollama", messages=messages, stream=False)
    assert "ollama-client the newest question" in (reply.message.content or "")
    assert mock_stats(gateway.mocks["llamacpp"])["context_overflows"] == 1
    *_, sent = gateway.seen("llamacpp")
    assert sent["messages"][0]["content"] == messages[0]["content"]
    assert sent["messages"][-1]["content"] == messages[-1]["content"]
    assert len(sent["messages"]) < len(messages)
