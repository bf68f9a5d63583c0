"""Splits, shadows, hedging and explaining a past request, through real parts.

One Nexus server (Daphne) and six mock servers serve the module; the
official ``openai`` client sends. The configuration comes from a TOML file
(``nexus_import_config``), as an operator would write it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from django.conf import settings
from django.core.management import call_command
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from routing.core.traffic import Split, SplitSide, hash_point
from routing.models import RoutingPolicy, ShadowComparison
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    mock_stats,
    start_mock_backend,
    start_nexus_server,
    wait_until,
)
from tests.factories import StaffUserFactory
from usage.models import ApiKey, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

SHIPS_TO_REDIS = settings.NEXUS_USAGE_TRANSPORT == "redis"
CHAT = Split("chat", (SplitSide("llama3:8b", 90), SplitSide("qwen2.5:7b", 10)))
SHADOWED, SLOW_SHADOW, HEDGED = "mistral:7b", "slow-shadow", "m-hedge"
STREAMED = "phi3"  # every request shadowed, asked for as a stream
# The shadow model is 10x slower than the model it shadows.
PRIMARY_MS, SHADOW_MS = 60, 600
CONFIG = f"""
[routing]
# The first attempt always goes to the first backend (hedge-a, the one with
# the slow tail); its hedge to the next (hedge-b).
strategy = "priority_only"

[routing.splits."chat"]
targets = {{ "llama3:8b" = 90, "qwen2.5:7b" = 10 }}
sticky = "key"

[routing.shadows."{SHADOWED}"]
model = "{SLOW_SHADOW}"
percent = 50
timeout_seconds = 10

[routing.shadows."{STREAMED}"]
model = "{SLOW_SHADOW}"
percent = 100

[routing.hedging."{HEDGED}"]
after = "p95"
after_ms = 150
max_extra = 1
"""
_blocker: Any = None


@dataclass
class Setup:
    server: NexusServer
    mocks: dict[str, MockBackendProcess]
    keys: dict[str, str]  # visible prefix -> secret
    token: str

    def client(self, prefix: str | None = None) -> openai.OpenAI:
        key = self.keys[prefix] if prefix else next(iter(self.keys.values()))
        return openai.OpenAI(
            base_url=f"{self.server.base_url}/v1", api_key=key, max_retries=0
        )


def _records(request_ids: list[str], limit: float = 30.0) -> dict[str, UsageRecord]:
    """Wait for these requests' usage rows (read outside any test transaction)."""
    deadline = time.monotonic() + limit
    while True:
        with _blocker.unblock():
            if SHIPS_TO_REDIS:
                drain_usage_stream()
            found = {
                record.request_id: record
                for record in UsageRecord.objects.filter(request_id__in=request_ids)
            }
        if len(found) >= len(set(request_ids)):
            return found
        assert time.monotonic() < deadline, f"{len(found)} of {len(request_ids)}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def setup(
    django_db_setup: None, django_db_blocker: Any, tmp_path_factory: Any
) -> Iterator[Setup]:
    global _blocker
    _blocker = django_db_blocker
    mocks: dict[str, MockBackendProcess] = {}
    server = None
    # A 5 % tail of 2 s first bytes.
    tail = ("--slow-rate", "0.05", "--slow-ms", "2000")
    nodes: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
        "split-a": (("llama3:8b", SHADOWED), ("--latency-ms", str(PRIMARY_MS))),
        "split-b": (("qwen2.5:7b", STREAMED), ("--latency-ms", "5")),
        "shadow-s": (
            (SLOW_SHADOW,),
            ("--latency-ms", str(SHADOW_MS), "--record-requests", "100"),
        ),
        "hedge-a": ((HEDGED,), (*tail, "--seed", "3")),
        "hedge-b": ((HEDGED,), ()),
    }
    try:
        for name, (models, knobs) in nodes.items():
            mocks[name] = start_mock_backend(
                "--name", name, "--models", ",".join(models), *knobs
            )
        with django_db_blocker.unblock():
            if SHIPS_TO_REDIS:
                clear_usage_stream()
            for name, (models, _) in nodes.items():
                backend = Backend.objects.create(
                    name=name,
                    base_url=mocks[name].base_url,
                    status=HealthStatus.HEALTHY,
                )
                for model in models:
                    BackendModel.objects.create(backend=backend, name=model)
            policy = RoutingPolicy.load()
            policy.admission_enabled = False
            policy.save()
            path = tmp_path_factory.mktemp("traffic") / "nexus.toml"
            Path(path).write_text(CONFIG)
            call_command("nexus_import_config", str(path), stdout=StringIO())
            # Keys on both sides of the 90/10 split: the side a key lands on
            # is its prefix's hash, so create keys until two land on the 10 %.
            keys: dict[str, str] = {}
            minority = 0
            for n in range(200):
                key, secret = ApiKey.objects.create_key(f"traffic-{n}")
                if CHAT.side_at(hash_point("chat", key.prefix)) == "qwen2.5:7b":
                    minority += 1
                elif len(keys) - minority >= 4:
                    continue
                keys[key.prefix] = secret
                if minority >= 2 and len(keys) >= 6:
                    break
            token = Token.objects.create(user=StaffUserFactory()).key
        server = start_nexus_server(NEXUS_BREAKER_FAILURES="1000000")
        yield Setup(server, mocks, keys, token)
    finally:
        if server is not None:
            server.stop()
        for mock in mocks.values():
            mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def _ask(client: openai.OpenAI, model: str, text: str = "hello") -> tuple[str, str]:
    request_id = f"tr-{uuid.uuid4().hex[:16]}"
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        extra_headers={"x-request-id": request_id},
    )
    raw.parse()
    return raw.headers["x-nexus-backend"], request_id


def test_a_key_stays_on_its_side_and_usage_names_the_split(setup: Setup) -> None:
    sides = {prefix: CHAT.side_at(hash_point("chat", prefix)) for prefix in setup.keys}
    assert set(sides.values()) == {"llama3:8b", "qwen2.5:7b"}
    backend_of = {"llama3:8b": "split-a", "qwen2.5:7b": "split-b"}
    request_ids = []
    for prefix, side in sides.items():
        client = setup.client(prefix)
        for _ in range(3):
            backend, request_id = _ask(client, "chat")
            assert backend == backend_of[side], (prefix, side)
            request_ids.append(request_id)
    listed = {m.id: m.owned_by for m in setup.client().models.list()}
    assert listed["chat"] == "split:llama3:8b,qwen2.5:7b"
    records = _records(request_ids)
    for record in records.values():
        assert record.requested_model == "chat"
        assert record.split == "chat"
        assert record.split_side == record.served_model
        assert sides[record.api_key_prefix] == record.split_side
    out = StringIO()
    with _blocker.unblock():
        call_command("nexus_usage", "--by", "split", stdout=out)
    report = out.getvalue()
    assert "llama3:8b" in report
    assert "chat" in report


def test_the_explain_api_and_command_show_a_past_decision(setup: Setup) -> None:
    prefix = next(iter(setup.keys))
    _, request_id = _ask(setup.client(prefix), "chat")
    _records([request_id])
    answer = httpx.get(
        f"{setup.server.base_url}/api/v1/requests/{request_id}/explain",
        headers={"Authorization": f"Token {setup.token}"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    served = answer.json()["requests"][0]
    decision = served["decision"]
    assert served["split"] == "chat"
    assert decision["split"]["side"] == served["split_side"]
    assert decision["chosen"]["backend"] == served["backend"]
    assert decision["candidates"][0]["backend"] == served["backend"]
    assert "score" in decision["candidates"][0]
    assert served["hedged"] is False
    out = StringIO()
    with _blocker.unblock():
        call_command("nexus_route", "--request-id", request_id, stdout=out)
    text = out.getvalue()
    assert f"split 'chat': side {served['split_side']}" in text
    assert "candidates" in text
    missing = httpx.get(
        f"{setup.server.base_url}/api/v1/requests/no-such-id/explain",
        headers={"Authorization": f"Token {setup.token}"},
        timeout=10,
    )
    assert missing.status_code == 404


def test_shadows_never_delay_the_client_and_are_compared(setup: Setup) -> None:
    client = setup.client()
    latencies = []
    started_at: dict[str, float] = {}
    request_ids = []
    for n in range(30):
        started, wall = time.perf_counter(), time.time()
        _, request_id = _ask(client, SHADOWED, f"question number {n}")
        latencies.append((time.perf_counter() - started) * 1000)
        started_at[request_id] = wall
        request_ids.append(request_id)
    # A client's answer never waited for its shadow, 10x slower: each came
    # back before a shadow could have answered.
    assert max(latencies) < SHADOW_MS, latencies
    shadow = setup.mocks["shadow-s"]
    seen = wait_until(
        lambda: (
            mock_stats(shadow)["requests_total"] >= 5
            and mock_stats(shadow)["in_flight"] == 0
            and mock_stats(shadow)["requests_total"]
        ),
        what="the shadow's requests",
    )
    # About percent (50 %) of the 30 requests were mirrored.
    assert 5 <= seen <= 25, seen

    def stored() -> list[ShadowComparison]:
        with _blocker.unblock():
            rows = list(ShadowComparison.objects.select_related("shadow"))
        return rows if len(rows) >= seen else []

    comparisons = wait_until(stored, what="the comparisons stored")
    for comparison in comparisons:
        assert comparison.request_id in request_ids
        assert comparison.shadow_error == ""
        assert comparison.shadow_latency_ms >= SHADOW_MS
        assert comparison.primary_latency_ms < SHADOW_MS
        # Both mocks echo the question: similar, not the same.
        assert 0.3 < comparison.similarity < 1.0
        assert "question number" in comparison.primary_answer
        assert "slow-shadow" in comparison.shadow_answer
    # Each shadow request left only once its client's answer was whole: it
    # reached the shadow server at least the primary's latency after the
    # client asked (sent beside the primary, it would arrive at once).
    recorded = mock_stats(shadow)["last_requests"]
    for request in recorded:
        client_id = request["headers"]["x-request-id"].removesuffix("-shadow")
        assert request["received_at"] - started_at[client_id] >= PRIMARY_MS / 1000
    assert len(recorded) == seen
    # The shadow's usage is billed to the shadow pseudo-key, never a client's.
    shadow_records = _wait_shadow_records(len(comparisons))
    assert {r.api_key_prefix for r in shadow_records} == {"shadow"}
    client_records = _records(request_ids)
    assert all(r.backend == "split-a" for r in client_records.values())


def test_a_streamed_answer_is_put_together_for_its_comparison(setup: Setup) -> None:
    request_id = f"tr-{uuid.uuid4().hex[:16]}"
    stream = setup.client().chat.completions.create(
        model=STREAMED,
        messages=[{"role": "user", "content": "stream this answer please"}],
        stream=True,
        extra_headers={"x-request-id": request_id},
    )
    text = "".join(
        chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
    )
    assert "stream this answer please" in text

    def stored() -> ShadowComparison | None:
        with _blocker.unblock():
            return ShadowComparison.objects.filter(request_id=request_id).first()

    comparison = wait_until(stored, what="the streamed request's comparison")
    assert comparison.primary_answer == text
    assert comparison.primary_finish == "stop"
    assert "stream this answer please" in comparison.shadow_answer
    assert 0.3 < comparison.similarity < 1.0


def test_an_anthropic_clients_request_is_shadowed_as_a_chat(setup: Setup) -> None:
    request_id = f"tr-{uuid.uuid4().hex[:16]}"
    client = anthropic.Anthropic(
        base_url=setup.server.base_url,
        api_key=next(iter(setup.keys.values())),
        max_retries=0,
        default_headers={"x-request-id": request_id},
    )
    message = client.messages.create(
        model=STREAMED,
        max_tokens=64,
        messages=[{"role": "user", "content": "from the messages API"}],
    )
    text = "".join(block.text for block in message.content if block.type == "text")

    def stored() -> ShadowComparison | None:
        with _blocker.unblock():
            return ShadowComparison.objects.filter(request_id=request_id).first()

    comparison = wait_until(stored, what="the Anthropic request's comparison")
    assert comparison.primary_answer == text
    assert "from the messages API" in comparison.shadow_answer
    assert comparison.prompt == "from the messages API"


def _wait_shadow_records(count: int) -> list[UsageRecord]:
    def found() -> list[UsageRecord]:
        with _blocker.unblock():
            if SHIPS_TO_REDIS:
                drain_usage_stream()
            rows = list(UsageRecord.objects.filter(requested_model=SLOW_SHADOW))
        return rows if len(rows) >= count else []

    return wait_until(found, what="the shadows' usage")


def test_hedging_cuts_the_tail_and_bills_the_winner_only(setup: Setup) -> None:
    client = setup.client()
    latencies = []
    served: dict[str, str] = {}
    for n in range(200):
        started = time.perf_counter()
        backend, request_id = _ask(client, HEDGED, f"hedged {n}")
        latencies.append((time.perf_counter() - started) * 1000)
        served[request_id] = backend
    server = setup.server
    slow = mock_stats(setup.mocks["hedge-a"])["slow_requests"]
    won_by_hedge = server.metric("nexus_hedge_wins_total", 'winner="hedge"')
    # Every request whose first attempt was in the 2 s tail was answered by
    # its hedge: without hedging, 3 of 200 in the tail put p99 at 2 s.
    assert slow >= 3, slow
    assert won_by_hedge >= slow
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    assert p99 < 1000, latencies[-10:]
    assert server.metric("nexus_hedge_waste_tokens_total") > 0
    # The losers' upstream connections were closed at once: every request
    # hedge-a put in the tail saw its client leave while it slept there.
    wait_until(
        lambda: mock_stats(setup.mocks["hedge-a"])["client_disconnects"] == slow,
        what="the losers' connections closed",
    )
    # One usage record per request, for the backend that answered it.
    records = _records(list(served))
    assert len(records) == len(served)
    for request_id, record in records.items():
        assert record.backend == served[request_id]
    hedged = [r for r in records.values() if r.hedged]
    assert len(hedged) >= won_by_hedge
    with _blocker.unblock():
        assert UsageRecord.objects.filter(request_id__in=list(served)).count() == 200


def test_a_stream_is_hedged_at_its_first_event(setup: Setup) -> None:
    slow_node = setup.mocks["hedge-a"]
    knobs = f"{slow_node.base_url}/_mock/config"
    httpx.post(knobs, json={"slow_rate": 1.0}, timeout=5).raise_for_status()
    try:
        before = mock_stats(slow_node)["client_disconnects"]
        started = time.perf_counter()
        request_id = f"tr-{uuid.uuid4().hex[:16]}"
        raw = setup.client().chat.completions.with_raw_response.create(
            model=HEDGED,
            messages=[{"role": "user", "content": "a hedged stream"}],
            stream=True,
            extra_headers={"x-request-id": request_id},
        )
        text = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in raw.parse()
            if chunk.choices
        )
        took = time.perf_counter() - started
    finally:
        httpx.post(knobs, json={"slow_rate": 0.05}, timeout=5).raise_for_status()
    # The first attempt (hedge-a) slept in its 2 s tail; the hedge answered.
    assert raw.headers["x-nexus-backend"] == "hedge-b"
    assert "[hedge-b/m-hedge] echo: a hedged stream" in text
    assert took < 1.5, took
    wait_until(
        lambda: mock_stats(slow_node)["client_disconnects"] == before + 1,
        what="the slow attempt's connection closed",
    )
    record = _records([request_id])[request_id]
    assert record.hedged and record.streamed and record.backend == "hedge-b"
