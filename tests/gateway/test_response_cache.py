"""The exact response cache through real processes (issue 32, docs/caching.md).

Daphne serves Nexus with ``[cache]`` on; mock backends (real HTTP processes
that count what they get) answer the misses; the official openai, anthropic
and ollama clients ask. A hit is told by ``x-nexus-cache: hit`` and by the
mock not seeing the request. In production mode the entries are in Redis, in
the embedded default in the serving process's memory.
"""

from __future__ import annotations

import json
import time
import uuid
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
from django.test import Client

from backends.models import Backend, BackendModel, HealthStatus
from routing.cache_purge import purge_cache
from routing.models import RoutingPolicy
from routing.versioning import read_config_version
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    mock_stats,
    start_mock_backend,
    start_nexus_server,
    wait_until,
)
from tests.factories import StaffUserFactory
from usage.models import ApiKey, ModelPrice, UsageRecord
from usage.rollup import roll_up_usage
from usage.stream import clear_usage_stream, drain_usage_stream

SHIPS_TO_REDIS = settings.NEXUS_USAGE_TRANSPORT == "redis"
PRODUCTION = bool(settings.REDIS_URL)
MODEL = "cache-llama"
OTHER = "cache-mistral"
CLAUDE = "cache-claude"  # served by an Anthropic-kind mock (passed through)


@dataclass
class Setup:
    server: NexusServer
    mock: MockBackendProcess
    claude: MockBackendProcess
    key_a: str
    key_b: str
    prefix_a: str
    blocker: Any

    def openai(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.server.base_url + "/v1",
            api_key=key or self.key_a,
            timeout=20,
            max_retries=0,
        )

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.server.base_url,
            api_key=self.key_a,
            timeout=20,
            max_retries=0,
        )

    def ollama(self) -> ollama.Client:
        return ollama.Client(
            host=self.server.base_url,
            headers={"Authorization": f"Bearer {self.key_a}"},
            timeout=20,
        )

    def post(
        self, path: str, body: bytes, key: str | None = None, **headers: str
    ) -> httpx.Response:
        return httpx.post(
            self.server.base_url + path,
            content=body,
            headers={
                "Authorization": f"Bearer {key or self.key_a}",
                "Content-Type": "application/json",
                **headers,
            },
            timeout=20,
        )

    def seen(self, mock: MockBackendProcess | None = None) -> int:
        """Inference requests the mock has answered."""
        stats = mock_stats(mock or self.mock)
        return sum(
            count
            for path, count in stats["requests"].items()
            if path in ("/v1/chat/completions", "/v1/messages", "/v1/embeddings")
        )

    def set_policy(self, **fields: Any) -> None:
        """Change the cache settings and wait until the server routes with them."""
        with self.blocker.unblock():
            RoutingPolicy.objects.filter(pk=RoutingPolicy.SINGLETON_PK).update(**fields)
            RoutingPolicy.load().save()  # saved through the model: a new version
            version = read_config_version()
        self.wait_for_version(version)

    def purge(self, **what: str) -> None:
        with self.blocker.unblock():
            purge_cache(**what)
            version = read_config_version()
        self.wait_for_version(version)

    def wait_for_version(self, version: int) -> None:
        wait_until(
            lambda: self.server.metric("nexus_config_version") >= version,
            what=f"config version {version} on the server",
        )


@pytest.fixture(scope="module")
def setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[Setup]:
    mock = start_mock_backend("--models", f"{MODEL},{OTHER}", "--name", "mock-c")
    claude = start_mock_backend(
        "--kind", "anthropic", "--models", CLAUDE, "--name", "claude-c"
    )
    try:
        with django_db_blocker.unblock():
            if SHIPS_TO_REDIS:
                clear_usage_stream()
            for name, url, kind, models in (
                ("mock-c", mock.base_url, "openai", (MODEL, OTHER)),
                ("claude-c", claude.base_url, "anthropic", (CLAUDE,)),
            ):
                backend = Backend.objects.create(
                    name=name, base_url=url, kind=kind, status=HealthStatus.HEALTHY
                )
                for model in models:
                    BackendModel.objects.create(backend=backend, name=model)
            policy = RoutingPolicy.load()
            policy.cache_enabled = True
            policy.save()
            key_a_row, key_a = ApiKey.objects.create_key("cache-a")
            _, key_b = ApiKey.objects.create_key("cache-b")
            prefix_a = key_a_row.prefix
        _forget_cached_answers()
        server = start_nexus_server()
        try:
            yield Setup(server, mock, claude, key_a, key_b, prefix_a, django_db_blocker)
        finally:
            server.stop()
    finally:
        mock.stop()
        claude.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)
        _forget_cached_answers()


def _forget_cached_answers() -> None:
    if not PRODUCTION:
        return
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL)
    keys = list(client.scan_iter("nexus:{cache}:*"))
    if keys:
        client.delete(*keys)


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        **extra,
    }


def unique(what: str) -> str:
    return f"{what} {uuid.uuid4().hex[:8]}"


def usage_records(request_id: str, blocker: Any) -> UsageRecord:
    deadline = time.monotonic() + 15
    with blocker.unblock():
        while True:
            if SHIPS_TO_REDIS:
                drain_usage_stream()
            record = UsageRecord.objects.filter(request_id=request_id).first()
            if record is not None:
                return record
            assert time.monotonic() < deadline, "usage was not recorded"
            time.sleep(0.1)


def test_identical_requests_hit_from_the_sdk_and_from_raw_json(setup: Setup) -> None:
    text = unique("identical")
    client = setup.openai()
    before = setup.seen()
    first = client.chat.completions.with_raw_response.create(**chat(text))
    assert first.headers["x-nexus-cache"] == "miss"
    second = client.chat.completions.with_raw_response.create(**chat(text))
    assert second.headers["x-nexus-cache"] == "hit"
    assert second.parse().choices[0].message.content == (
        first.parse().choices[0].message.content
    )
    assert second.parse().usage == first.parse().usage
    # The same request as curl would send it: keys in another order, 0.0.
    body = (
        '{"temperature": 0.0, "stream": false, "messages": [{"content": '
        + json.dumps(text)
        + ', "role": "user"}], "user": "someone", "model": "'
        + MODEL
        + '"}'
    )
    raw = setup.post("/v1/chat/completions", body.encode())
    assert raw.status_code == 200
    assert raw.headers["x-nexus-cache"] == "hit"
    assert raw.json()["choices"][0]["message"]["content"] == (
        first.parse().choices[0].message.content
    )
    assert setup.seen() == before + 1


def test_a_hit_is_recorded_with_its_tokens_and_the_hit_price(setup: Setup) -> None:
    with setup.blocker.unblock():
        ModelPrice.objects.create(
            model=OTHER,
            input_per_million=1,
            output_per_million=2,
            cache_hit_per_million=100,
        )
        version = read_config_version()
    setup.wait_for_version(version)
    request = {**chat(unique("priced")), "model": OTHER}
    client = setup.openai()
    first = client.chat.completions.with_raw_response.create(**request)
    second = client.chat.completions.with_raw_response.create(**request)
    assert second.headers["x-nexus-cache"] == "hit"
    miss = usage_records(first.headers["x-request-id"], setup.blocker)
    hit = usage_records(second.headers["x-request-id"], setup.blocker)
    assert (miss.cache_hit, hit.cache_hit) == (False, True)
    assert hit.prompt_tokens == miss.prompt_tokens > 0
    assert hit.completion_tokens == miss.completion_tokens > 0
    assert hit.backend == ""
    assert hit.served_model == OTHER
    # 100 USD per million tokens of the hit = 100,000 nano-USD a token.
    assert hit.cost_nanos == hit.total_tokens * 100_000
    assert miss.cost_nanos == miss.prompt_tokens * 1000 + miss.completion_tokens * 2000


def test_another_tenant_misses_under_key_scope_and_hits_under_shared(
    setup: Setup,
) -> None:
    text = unique("tenants")
    first = setup.openai().chat.completions.with_raw_response.create(**chat(text))
    assert first.headers["x-nexus-cache"] == "miss"
    other = setup.openai(setup.key_b).chat.completions.with_raw_response.create(
        **chat(text)
    )
    assert other.headers["x-nexus-cache"] == "miss"
    setup.set_policy(cache_scope="shared")
    try:
        shared = unique("shared")
        a = setup.openai().chat.completions.with_raw_response.create(**chat(shared))
        b = setup.openai(setup.key_b).chat.completions.with_raw_response.create(
            **chat(shared)
        )
        assert (a.headers["x-nexus-cache"], b.headers["x-nexus-cache"]) == (
            "miss",
            "hit",
        )
    finally:
        setup.set_policy(cache_scope="key")


def test_a_sampled_request_bypasses_unless_it_opts_in(setup: Setup) -> None:
    text = unique("sampled")
    client = setup.openai()
    before = setup.seen()
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            **chat(text, temperature=0.7)
        )
        assert raw.headers["x-nexus-cache"] == "bypass"
    assert setup.seen() == before + 2
    opted = client.with_options(default_headers={"x-nexus-cache": "on"})
    results = [
        opted.chat.completions.with_raw_response.create(
            **chat(text, temperature=0.7)
        ).headers["x-nexus-cache"]
        for _ in range(2)
    ]
    assert results == ["miss", "hit"]
    # A seed makes it repeatable too.
    seeded = [
        client.chat.completions.with_raw_response.create(
            **chat(text, temperature=0.7, seed=7)
        ).headers["x-nexus-cache"]
        for _ in range(2)
    ]
    assert seeded == ["miss", "hit"]


def test_cache_control_no_cache_and_no_store(setup: Setup) -> None:
    text = unique("control")
    body = json.dumps(chat(text)).encode()
    stored = setup.post("/v1/chat/completions", body, **{"Cache-Control": "no-store"})
    assert stored.headers["x-nexus-cache"] == "bypass"
    # Nothing was stored: a plain request misses.
    assert setup.post("/v1/chat/completions", body).headers["x-nexus-cache"] == "miss"
    before = setup.seen()
    fresh = setup.post("/v1/chat/completions", body, **{"Cache-Control": "no-cache"})
    assert fresh.headers["x-nexus-cache"] == "miss"  # not looked up: computed
    assert setup.seen() == before + 1
    assert setup.post("/v1/chat/completions", body).headers["x-nexus-cache"] == "hit"
    bad = setup.post("/v1/chat/completions", body, **{"x-nexus-cache-ttl": "soon"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "x-nexus-cache-ttl"


def test_an_openai_stream_hit_is_replayed_with_its_usage_chunk(setup: Setup) -> None:
    text = unique("stream " + "word " * 30)
    client = setup.openai()

    def stream() -> tuple[str, str, list[Any]]:
        raw = client.chat.completions.with_raw_response.create(
            **chat(text), stream=True, stream_options={"include_usage": True}
        )
        chunks = list(raw.parse())
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return raw.headers["x-nexus-cache"], content, chunks

    before = setup.seen()
    state, live, live_chunks = stream()
    assert state == "miss"
    state, replayed, chunks = stream()
    assert state == "hit"
    assert replayed == live
    assert setup.seen() == before + 1
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) > 1  # chunked like a live one
    assert chunks[-1].choices == [] and chunks[-1].usage == live_chunks[-1].usage
    assert chunks[-1].usage.completion_tokens > 0
    # Whole or streamed, the same entry: a non-streamed request hits too.
    whole = client.chat.completions.with_raw_response.create(**chat(text))
    assert whole.headers["x-nexus-cache"] == "hit"
    assert whole.parse().choices[0].message.content == live


def test_an_anthropic_stream_hit_is_replayed_with_its_usage(setup: Setup) -> None:
    text = unique("anthropic stream")
    client = setup.anthropic()
    request = {
        "model": MODEL,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": text}],
        "extra_body": {"temperature": 0},
    }
    answers = []
    for expected in ("miss", "hit"):
        with client.messages.stream(**request) as stream:
            assert stream.response.headers["x-nexus-cache"] == expected
            texts = list(stream.text_stream)
            message = stream.get_final_message()
        answers.append((texts, message))
    (live_texts, live), (texts, replayed) = answers
    assert "".join(texts) == "".join(live_texts)
    assert len(texts) > 1
    assert replayed.usage.input_tokens == live.usage.input_tokens > 0
    assert replayed.usage.output_tokens == live.usage.output_tokens > 0
    assert replayed.stop_reason == live.stop_reason


def test_a_native_anthropic_stream_is_kept_and_replayed(setup: Setup) -> None:
    text = unique("native")
    client = setup.anthropic()
    request = {
        "model": CLAUDE,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": text}],
        "extra_body": {"temperature": 0},
    }
    before = setup.seen(setup.claude)
    results = []
    for _ in range(2):
        with client.messages.stream(**request) as stream:
            results.append(
                (
                    stream.response.headers["x-nexus-cache"],
                    "".join(stream.text_stream),
                    stream.get_final_message().usage.output_tokens,
                )
            )
    assert [r[0] for r in results] == ["miss", "hit"]
    assert results[0][1:] == results[1][1:]
    assert setup.seen(setup.claude) == before + 1


def test_an_ollama_stream_hit_is_replayed_and_surfaces_share_entries(
    setup: Setup,
) -> None:
    text = unique("ollama")
    # Asked through the OpenAI surface first: the same model and messages
    # through Ollama's are the same upstream request.
    first = setup.openai().chat.completions.with_raw_response.create(**chat(text))
    assert first.headers["x-nexus-cache"] == "miss"
    answer = first.parse().choices[0].message.content
    parts = list(
        setup.ollama().chat(
            model=MODEL,
            messages=[{"role": "user", "content": text}],
            options={"temperature": 0},
            stream=True,
        )
    )
    assert "".join(p.message.content or "" for p in parts) == answer
    assert len(parts) > 2
    last = parts[-1]
    assert last.done
    assert last.prompt_eval_count == first.parse().usage.prompt_tokens
    assert last.eval_count == first.parse().usage.completion_tokens
    raw = httpx.post(
        setup.server.base_url + "/api/chat",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "options": {"temperature": 0},
            "stream": False,
        },
        headers={"Authorization": f"Bearer {setup.key_a}"},
        timeout=20,
    )
    assert raw.headers["x-nexus-cache"] == "hit"
    assert raw.json()["message"]["content"] == answer


def test_an_answer_over_max_entry_bytes_is_not_stored(setup: Setup) -> None:
    setup.set_policy(cache_max_entry_bytes=64)
    try:
        text = unique("large")
        states = [
            setup.openai()
            .chat.completions.with_raw_response.create(**chat(text))
            .headers["x-nexus-cache"]
            for _ in range(2)
        ]
        assert states == ["miss", "miss"]
        assert setup.server.metric("nexus_cache_stores_total", 'result="too_large"')
    finally:
        setup.set_policy(cache_max_entry_bytes=1024 * 1024)


def test_an_entry_expires_after_its_ttl(setup: Setup) -> None:
    body = json.dumps(chat(unique("ttl"))).encode()
    headers = {"x-nexus-cache-ttl": "1"}
    assert (
        setup.post("/v1/chat/completions", body, **headers).headers["x-nexus-cache"]
        == "miss"
    )
    wait_until(
        lambda: (
            setup.post("/v1/chat/completions", body).headers["x-nexus-cache"] == "hit"
        ),
        what="the answer stored",
    )
    expired_at = time.monotonic()
    wait_until(
        lambda: (
            setup.post("/v1/chat/completions", body, **headers).headers["x-nexus-cache"]
            == "miss"
        ),
        timeout=10,
        what="the entry to expire",
    )
    assert time.monotonic() - expired_at < 5


def test_purge_all_per_model_and_per_key(setup: Setup) -> None:
    texts = {name: unique(f"purge {name}") for name in ("all", "model", "key")}

    def state(text: str, model: str = MODEL, key: str | None = None) -> str:
        raw = setup.openai(key).chat.completions.with_raw_response.create(
            **{**chat(text), "model": model}
        )
        return raw.headers["x-nexus-cache"]

    for text in texts.values():
        state(text)
        state(text, OTHER)
        state(text, OTHER, key=setup.key_b)
    assert state(texts["model"]) == "hit"
    setup.purge(model=MODEL)
    assert state(texts["model"]) == "miss"
    assert state(texts["model"], OTHER) == "hit"
    assert state(texts["key"], OTHER) == "hit"
    setup.purge(key_prefix=setup.prefix_a)
    assert state(texts["key"], OTHER) == "miss"
    assert state(texts["key"], OTHER, key=setup.key_b) == "hit"
    setup.purge()
    assert state(texts["all"], OTHER, key=setup.key_b) == "miss"


def test_the_purge_api_and_the_hit_report(setup: Setup, django_db_blocker: Any) -> None:
    text = unique("api")
    for _ in range(2):
        raw = setup.openai().chat.completions.with_raw_response.create(**chat(text))
        usage_records(raw.headers["x-request-id"], django_db_blocker)
    with django_db_blocker.unblock():
        roll_up_usage()
        admin_client = Client()
        admin_client.force_login(
            StaffUserFactory(username="cache-admin", is_superuser=True)
        )
        answer = admin_client.get("/api/v1/cache")
        assert answer.status_code == 200
        report = answer.json()
        assert report["settings"]["enabled"] is True
        row = next(r for r in report["models"] if r["model"] == MODEL)
        assert row["cache_hits"] >= 1 and row["tokens_saved"] > 0
        assert 0 < row["hit_rate"] <= 1
        purged = admin_client.post(
            "/api/v1/cache/purge", {"model": MODEL}, content_type="application/json"
        )
        assert purged.status_code == 200 and purged.json()["model"] == MODEL
        version = read_config_version()
        page = admin_client.get("/admin/routing/routingpolicy/cache/")
        assert page.status_code == 200 and MODEL in page.content.decode()
    setup.wait_for_version(version)
    raw = setup.openai().chat.completions.with_raw_response.create(**chat(text))
    assert raw.headers["x-nexus-cache"] == "miss"


@pytest.mark.skipif(not PRODUCTION, reason="the embedded default has no Redis")
def test_redis_down_serves_uncached_and_counts(
    setup: Setup, django_db_blocker: Any
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]  # nothing listens once it is closed
    server = start_nexus_server(NEXUS_CACHE_REDIS_URL=f"redis://127.0.0.1:{closed}/0")
    try:
        client = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=setup.key_a, max_retries=0
        )
        text = unique("redis down")
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(**chat(text))
            assert raw.status_code == 200
            assert raw.headers["x-nexus-cache"] == "miss"
            assert raw.parse().choices[0].message.content
        wait_until(lambda: server.metric("nexus_cache_errors_total") >= 3)
        logged = [line for line in server.log if "response cache could not" in line]
        assert len(logged) == 1  # once a minute
    finally:
        server.stop()


def test_hits_count_against_requests_per_minute_not_tokens(setup: Setup) -> None:
    with setup.blocker.unblock():
        _, tokens_key = ApiKey.objects.create_key("cache-tpm", tpm_limit=5)
        _, requests_key = ApiKey.objects.create_key("cache-rpm", rpm_limit=2)
        version = read_config_version()
    setup.wait_for_version(version)
    text = unique("limits")
    body = json.dumps(chat(text, max_tokens=30)).encode()
    assert setup.post("/v1/chat/completions", body, tokens_key).status_code == 200
    other = json.dumps(chat(unique("other"), max_tokens=30)).encode()
    refused = setup.post("/v1/chat/completions", other, tokens_key)
    assert refused.status_code == 429  # its tokens per minute are spent...
    for _ in range(3):  # ...and hits are served all the same
        hit = setup.post("/v1/chat/completions", body, tokens_key)
        assert hit.status_code == 200 and hit.headers["x-nexus-cache"] == "hit"
    states = [setup.post("/v1/chat/completions", body, requests_key) for _ in range(3)]
    assert [r.status_code for r in states] == [200, 200, 429]
    assert states[1].headers["x-nexus-cache"] == "hit"
    assert "requests per minute" in states[2].json()["error"]["message"]


def test_a_responses_stream_hit_is_replayed(setup: Setup) -> None:
    text = unique("responses")
    client = setup.openai()
    whole = client.responses.with_raw_response.create(
        model=MODEL, input=text, temperature=0
    )
    assert whole.headers["x-nexus-cache"] == "miss"
    answer = whole.parse().output_text
    raw = client.responses.with_raw_response.create(
        model=MODEL, input=text, temperature=0, stream=True
    )
    assert raw.headers["x-nexus-cache"] == "hit"
    events = list(raw.parse())
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == answer and len(deltas) > 1
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.usage.input_tokens == whole.parse().usage.input_tokens
