"""Prompt caching through real parts: breakpoints in, cached tokens out.

One Nexus server (Daphne) and five mocks (Anthropic, OpenAI, vLLM, llama.cpp
and Ollama kinds) serve the module; the official ``anthropic`` and ``openai``
clients send. The mocks record the bodies they got, and report cached prompt
tokens when their ``cached_tokens`` / ``cache_write_tokens`` knobs are set.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from io import StringIO
from typing import Any

import anthropic
import httpx
import openai
import pytest
from django.conf import settings
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from gateway.protocols.prompt_cache import count_breakpoints
from routing.models import RoutingPolicy
from tests.conftest import MockBackendProcess, start_mock_backend, start_nexus_server
from usage.models import ApiKey, ModelPrice, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

SHIPS_TO_REDIS = settings.NEXUS_USAGE_TRANSPORT == "redis"
UPSTREAM_KEY = "sk-ant-upstream"
CLAUDE, GPT, LLAMA, QWEN = "claude-pc", "gpt-pc", "llama-pc", "qwen-pc"
VLLM = "vllm-pc"
HOUR = {"type": "ephemeral", "ttl": "1h"}
SYSTEM = [
    {"type": "text", "text": "You are terse."},
    {"type": "text", "text": "A long, stable preamble.", "cache_control": HOUR},
]
TOOLS = [
    {
        "name": "lookup",
        "description": "Look a word up.",
        "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"},
    }
]
PLAIN_TOOL = {k: v for k, v in TOOLS[0].items() if k != "cache_control"}
MARKED_MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "the long document", "cache_control": HOUR},
            {"type": "text", "text": "hello there"},
        ],
    }
]
_blocker: Any = None


@dataclass
class Setup:
    base_url: str
    key: str
    mocks: dict[str, MockBackendProcess]

    def anthropic(self, request_id: str = "") -> anthropic.Anthropic:
        headers = {"x-request-id": request_id} if request_id else None
        return anthropic.Anthropic(
            base_url=self.base_url,
            api_key=self.key,
            max_retries=0,
            default_headers=headers,
        )

    def openai(self, request_id: str = "") -> openai.OpenAI:
        headers = {"x-request-id": request_id} if request_id else None
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.key,
            max_retries=0,
            default_headers=headers,
        )

    def last_body(self, model: str) -> dict[str, Any]:
        """The body of the last request the model's mock got."""
        stats = httpx.get(f"{self.mocks[model].base_url}/_mock/stats", timeout=5)
        body: dict[str, Any] = json.loads(stats.json()["last_requests"][-1]["body"])
        return body

    def last_raw(self, model: str) -> str:
        stats = httpx.get(f"{self.mocks[model].base_url}/_mock/stats", timeout=5)
        return str(stats.json()["last_requests"][-1]["body"])

    def cache(self, model: str, read: int, write: int = 0) -> None:
        """Make the model's mock report cached prompt tokens."""
        httpx.post(
            f"{self.mocks[model].base_url}/_mock/config",
            json={"cached_tokens": read, "cache_write_tokens": write},
            timeout=5,
        ).raise_for_status()


def _record(request_id: str, limit: float = 20.0) -> UsageRecord:
    """Wait for one request's usage row (read outside any test transaction)."""
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


def _set_auto_breakpoints(enabled: bool) -> None:
    with _blocker.unblock():
        policy = RoutingPolicy.load()
        policy.cache_anthropic_auto_breakpoints = enabled
        policy.save()


@pytest.fixture(scope="module")
def setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[Setup]:
    global _blocker
    _blocker = django_db_blocker
    mocks: dict[str, MockBackendProcess] = {}
    server = None
    kinds = {
        CLAUDE: "anthropic",
        GPT: "openai",
        VLLM: "vllm",
        LLAMA: "llamacpp",
        QWEN: "ollama",
    }
    try:
        for model, kind in kinds.items():
            extra = ("--api-key", UPSTREAM_KEY) if kind == "anthropic" else ()
            mocks[model] = start_mock_backend(
                "--models", model, "--name", f"pc-{kind}", "--kind", kind,
                "--chunks", "3", *extra,
            )  # fmt: skip
        with django_db_blocker.unblock():
            if SHIPS_TO_REDIS:
                clear_usage_stream()
            for model, kind in kinds.items():
                backend = Backend.objects.create(
                    name=f"pc-{kind}",
                    base_url=mocks[model].base_url,
                    kind=kind,
                    api_key=UPSTREAM_KEY if kind == "anthropic" else "",
                    status=HealthStatus.HEALTHY,
                )
                BackendModel.objects.create(
                    backend=backend, name=model, supports_tools=True
                )
            ModelPrice.objects.create(
                model=CLAUDE,
                input_per_million=Decimal(3),
                output_per_million=Decimal(15),
                cached_input_per_million=Decimal("0.3"),
                cache_write_per_million=Decimal("3.75"),
            )
            ModelPrice.objects.create(
                model=GPT,
                input_per_million=Decimal(2),
                output_per_million=Decimal(8),
                cached_input_per_million=Decimal("0.5"),
            )
            # No cached price: cached tokens cost the input price.
            ModelPrice.objects.create(
                model=LLAMA, input_per_million=Decimal(1), output_per_million=1
            )
            _, key = ApiKey.objects.create_key("prompt-cache")
        server = start_nexus_server(NEXUS_BREAKER_FAILURES="1000000")
        yield Setup(server.base_url, key, mocks)
    finally:
        if server is not None:
            server.stop()
        for mock in mocks.values():
            mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture
def cache_knobs(setup: Setup) -> Iterator[None]:
    yield
    for model in (CLAUDE, GPT, VLLM, LLAMA):
        setup.cache(model, 0, 0)


def _rid() -> str:
    return f"pc-{uuid.uuid4().hex[:16]}"


# cache_control in


@pytest.mark.parametrize("stream", [False, True])
def test_cache_control_reaches_an_anthropic_backend_untouched(
    setup: Setup, stream: bool
) -> None:
    client = setup.anthropic()
    ask: dict[str, Any] = {
        "model": CLAUDE,
        "max_tokens": 50,
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": MARKED_MESSAGES,
    }
    if stream:
        with client.messages.stream(**ask) as events:
            events.get_final_message()
    else:
        client.messages.create(**ask)
    body = setup.last_body(CLAUDE)
    assert body["system"] == SYSTEM
    assert body["tools"] == TOOLS
    assert body["messages"] == MARKED_MESSAGES
    assert count_breakpoints(body) == 3


@pytest.mark.parametrize("model", [GPT, VLLM, LLAMA, QWEN])
@pytest.mark.parametrize("stream", [False, True])
def test_cache_control_and_its_ttl_never_reach_other_kinds(
    setup: Setup, model: str, stream: bool
) -> None:
    # LiteLLM #39355: Claude Code's 1h ttl broke every non-Anthropic backend.
    client = setup.anthropic()
    ask: dict[str, Any] = {
        "model": model,
        "max_tokens": 50,
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": [
            *MARKED_MESSAGES,
            {"role": "assistant", "content": "ok"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "go on", "cache_control": HOUR}],
            },
        ],
        "cache_control": {"type": "ephemeral"},
    }
    if stream:
        with client.messages.stream(**ask) as events:
            events.get_final_message()
    else:
        client.messages.create(**ask)
    raw = setup.last_raw(model)
    assert "go on" in raw and "lookup" in raw
    assert "cache_control" not in raw
    assert "ttl" not in raw and "ephemeral" not in raw


def test_an_openai_clients_breakpoints_reach_an_anthropic_backend(
    setup: Setup,
) -> None:
    setup.openai().chat.completions.create(
        model=CLAUDE,
        max_tokens=20,
        messages=[
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "preamble", "cache_control": HOUR}  # type: ignore[typeddict-unknown-key]
                ],
            },
            {"role": "user", "content": "hello"},
        ],
    )
    body = setup.last_body(CLAUDE)
    assert body["system"] == [
        {"type": "text", "text": "preamble", "cache_control": HOUR}
    ]
    assert count_breakpoints(body) == 1


# Automatic breakpoints


def _unmarked(model: str = CLAUDE) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 20,
        "system": "You are terse. " * 20,
        "tools": [PLAIN_TOOL],
        "messages": [{"role": "user", "content": "hello"}],
    }


def _wait_for_breakpoints(setup: Setup, expected: int) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while True:
        setup.anthropic().messages.create(**_unmarked())
        body = setup.last_body(CLAUDE)
        if count_breakpoints(body) == expected:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.2)


def test_automatic_breakpoints_only_when_enabled_and_the_client_set_none(
    setup: Setup,
) -> None:
    plain = _unmarked()
    setup.anthropic().messages.create(**plain)
    assert "cache_control" not in setup.last_raw(CLAUDE)
    _set_auto_breakpoints(True)
    try:
        body = _wait_for_breakpoints(setup, 2)
        assert body["system"] == [
            {
                "type": "text",
                "text": plain["system"],
                "cache_control": {"type": "ephemeral"},
            }
        ]
        assert body["tools"][-1]["cache_control"] == {"type": "ephemeral"}
        assert body["messages"] == plain["messages"]
        # The client's own breakpoints: left as they are, none added.
        client = setup.anthropic()
        client.messages.create(
            model=CLAUDE,
            max_tokens=20,
            system=SYSTEM,
            tools=[PLAIN_TOOL],
            messages=[{"role": "user", "content": "hello"}],
        )
        body = setup.last_body(CLAUDE)
        assert body["system"] == SYSTEM
        assert "cache_control" not in body["tools"][0]
        four = [
            {
                "type": "text",
                "text": f"part {n}",
                "cache_control": {"type": "ephemeral"},
            }
            for n in range(4)
        ]
        client.messages.create(
            model=CLAUDE,
            max_tokens=20,
            system="stable",
            tools=[PLAIN_TOOL],
            messages=[{"role": "user", "content": four}],
        )
        body = setup.last_body(CLAUDE)
        assert count_breakpoints(body) == 4
        assert body["system"] == "stable"
        # Translated (an OpenAI client): the same two, on Anthropic's blocks.
        setup.openai().chat.completions.create(
            model=CLAUDE,
            max_tokens=20,
            messages=[
                {"role": "system", "content": "stable"},
                {"role": "user", "content": "hello"},
            ],
            tools=[
                {
                    "type": "function",
                    "function": {"name": "lookup", "parameters": {"type": "object"}},
                }
            ],
        )
        body = setup.last_body(CLAUDE)
        assert count_breakpoints(body) == 2
        assert body["system"][-1]["cache_control"] == {"type": "ephemeral"}
        # Never to another kind.
        setup.anthropic().messages.create(**{**plain, "model": GPT})
        assert "cache_control" not in setup.last_raw(GPT)
    finally:
        _set_auto_breakpoints(False)
    _wait_for_breakpoints(setup, 0)


# Cached tokens out


def _cost(prompt: int, completion: int, read: int, write: int, price: dict) -> int:
    """Nano-USD: prices are USD per million tokens, so x1000 per token."""
    uncached = prompt - read - write
    return int(
        1000
        * (
            uncached * price["input"]
            + read * price.get("cached", price["input"])
            + write * price.get("write", price["input"])
            + completion * price["output"]
        )
    )


CLAUDE_PRICE = {
    "input": Decimal(3),
    "output": Decimal(15),
    "cached": Decimal("0.3"),
    "write": Decimal("3.75"),
}
GPT_PRICE = {"input": Decimal(2), "output": Decimal(8), "cached": Decimal("0.5")}
LLAMA_PRICE = {"input": Decimal(1), "output": Decimal(1)}


@pytest.mark.usefixtures("cache_knobs")
@pytest.mark.parametrize("stream", [False, True])
def test_an_anthropic_backends_cache_reads_and_writes_are_recorded_and_priced(
    setup: Setup, stream: bool
) -> None:
    setup.cache(CLAUDE, 700, 300)
    rid = _rid()
    ask: dict[str, Any] = {
        "model": CLAUDE,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "one two three"}],
    }
    if stream:
        with setup.anthropic(rid).messages.stream(**ask) as events:
            usage = events.get_final_message().usage
    else:
        usage = setup.anthropic(rid).messages.create(**ask).usage
    assert usage.cache_read_input_tokens == 700
    assert usage.cache_creation_input_tokens == 300
    record = _record(rid)
    assert (record.cache_read_tokens, record.cache_write_tokens) == (700, 300)
    assert record.prompt_tokens == usage.input_tokens + 1000
    assert not record.estimated
    assert record.cost_nanos == _cost(
        record.prompt_tokens, record.completion_tokens, 700, 300, CLAUDE_PRICE
    )


@pytest.mark.usefixtures("cache_knobs")
@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_client_sees_an_anthropic_backends_cached_tokens(
    setup: Setup, stream: bool
) -> None:
    setup.cache(CLAUDE, 40, 10)
    rid = _rid()
    ask = {
        "model": CLAUDE,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if stream:
        chunks = list(
            setup.openai(rid).chat.completions.create(
                **ask, stream=True, stream_options={"include_usage": True}
            )
        )
        usage = chunks[-1].usage
    else:
        usage = setup.openai(rid).chat.completions.create(**ask).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 40
    assert usage.prompt_tokens_details.cache_write_tokens == 10
    record = _record(rid)
    assert record.prompt_tokens == usage.prompt_tokens
    assert (record.cache_read_tokens, record.cache_write_tokens) == (40, 10)
    # A Responses client: input_tokens_details.
    response = setup.openai().responses.create(model=CLAUDE, input="hi")
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens == 40
    assert response.usage.input_tokens_details.cache_write_tokens == 10


@pytest.mark.usefixtures("cache_knobs")
@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_backends_cached_tokens_are_recorded_and_priced(
    setup: Setup, stream: bool
) -> None:
    _ask_with_cached_tokens(setup, GPT, stream)


@pytest.mark.usefixtures("cache_knobs")
def test_vllms_cached_tokens_are_recorded(setup: Setup) -> None:
    # vLLM with prefix caching reports them as OpenAI does.
    _ask_with_cached_tokens(setup, VLLM, stream=True)


def _ask_with_cached_tokens(setup: Setup, model: str, stream: bool) -> None:
    setup.cache(model, 3)
    rid = _rid()
    ask = {
        "model": model,
        "messages": [{"role": "user", "content": "one two three four five"}],
    }
    if stream:
        chunks = list(
            setup.openai(rid).chat.completions.create(
                **ask, stream=True, stream_options={"include_usage": True}
            )
        )
        usage = chunks[-1].usage
    else:
        usage = setup.openai(rid).chat.completions.create(**ask).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 3
    record = _record(rid)
    assert (record.cache_read_tokens, record.cache_write_tokens) == (3, 0)
    if model != GPT:
        return
    assert record.cost_nanos == _cost(
        record.prompt_tokens, record.completion_tokens, 3, 0, GPT_PRICE
    )
    assert record.cost_nanos < _cost(
        record.prompt_tokens, record.completion_tokens, 0, 0, GPT_PRICE
    )


@pytest.mark.usefixtures("cache_knobs")
@pytest.mark.parametrize("stream", [False, True])
def test_an_anthropic_client_sees_an_openai_backends_cached_tokens(
    setup: Setup, stream: bool
) -> None:
    setup.cache(GPT, 2)
    rid = _rid()
    ask: dict[str, Any] = {
        "model": GPT,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "one two three four"}],
    }
    if stream:
        with setup.anthropic(rid).messages.stream(**ask) as events:
            usage = events.get_final_message().usage
    else:
        usage = setup.anthropic(rid).messages.create(**ask).usage
    assert usage.cache_read_input_tokens == 2
    record = _record(rid)
    assert record.cache_read_tokens == 2
    # Anthropic's input_tokens leave the cached ones out.
    assert usage.input_tokens == record.prompt_tokens - 2


@pytest.mark.usefixtures("cache_knobs")
@pytest.mark.parametrize("stream", [False, True])
def test_llamacpps_cache_timings_become_cached_tokens(
    setup: Setup, stream: bool
) -> None:
    setup.cache(LLAMA, 2)
    rid = _rid()
    ask = {"model": LLAMA, "messages": [{"role": "user", "content": "a b c d e f"}]}
    if stream:
        list(
            setup.openai(rid).chat.completions.create(
                **ask, stream=True, stream_options={"include_usage": True}
            )
        )
    else:
        setup.openai(rid).chat.completions.create(**ask)
    record = _record(rid)
    assert record.cache_read_tokens == 2
    # No cached_input price: cached tokens cost the input price.
    assert record.cost_nanos == _cost(
        record.prompt_tokens, record.completion_tokens, 0, 0, LLAMA_PRICE
    )
    translated = setup.anthropic().messages.create(
        model=LLAMA, max_tokens=20, messages=[{"role": "user", "content": "a b c"}]
    )
    assert translated.usage.cache_read_input_tokens == 2


@pytest.mark.usefixtures("cache_knobs")
def test_cached_tokens_roll_up_into_the_usage_report(setup: Setup) -> None:
    setup.cache(CLAUDE, 70, 30)
    rid = _rid()
    setup.anthropic(rid).messages.create(
        model=CLAUDE, max_tokens=20, messages=[{"role": "user", "content": "hi"}]
    )
    _record(rid)
    out = StringIO()
    with _blocker.unblock():
        call_command("nexus_flush_usage", verbosity=0, stdout=StringIO())
        call_command("nexus_usage", "--since", "all", "--json", stdout=out)
        records = UsageRecord.objects.filter(served_model=CLAUDE)
        read = sum(records.values_list("cache_read_tokens", flat=True))
        written = sum(records.values_list("cache_write_tokens", flat=True))
        prompt = sum(records.values_list("prompt_tokens", flat=True))
    rows = {row["model"]: row for row in json.loads(out.getvalue())["rows"]}
    assert read >= 70 and written >= 30
    assert rows[CLAUDE]["cache_read_tokens"] == read
    assert rows[CLAUDE]["cache_write_tokens"] == written
    assert rows[CLAUDE]["cached_share"] == pytest.approx(read / prompt)
