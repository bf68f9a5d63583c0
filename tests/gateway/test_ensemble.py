"""Multiple opinions (moe-<model>) through real processes and official clients.

Three mock backends of different kinds serve ``llama3:8b``. The mock answers
an ensemble's critique prompt with scores the question steers
(``prefer:<backend>``, ``garble``: nexus_mock.ensemble) and a refine prompt
with "[<backend>/<model>] refined: <the best answer>", so each test knows
which backend should win and what the client should read.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from django.conf import settings
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from gateway.proxy.ensemble import listed_ensembles, prompts
from routing.core import BackendSpec, ModelSpec, RouterSnapshot
from routing.core.ensemble_policy import EnsemblePolicy
from routing.models import Alias, RoutingPolicy
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    mock_stats,
    start_mock_backend,
    start_nexus_server,
    wait_until,
)
from usage.lost import LOST_ERROR, reconcile_lost_usage
from usage.models import ApiKey, OpenRequest, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

SHIPS_TO_REDIS = settings.NEXUS_USAGE_TRANSPORT == "redis"
MODEL = "llama3:8b"
CHAT_PATHS = ("/v1/chat/completions", "/api/chat")
# Each step's timeout: far above a mock's answer, short enough to wait out.
STEP_TIMEOUT = 5.0
# Backend name -> (kind, models, mock arguments). gamma fails every request
# holding "boom"; alpha and beta every one holding "allfailboom" (so gamma too).
MOCKS = {
    "alpha": ("openai", f"{MODEL},solo:1b", ("--fail-on-text", "allfailboom")),
    "beta": ("ollama", MODEL, ("--fail-on-text", "allfailboom")),
    "gamma": ("openai", MODEL, ("--fail-on-text", "boom")),
    "delta": ("openai", "broken:1b", ("--error-rate", "1")),
}


@dataclass
class Gateway:
    server: NexusServer
    mocks: dict[str, MockBackendProcess]
    key: str
    keys: dict[str, str]

    def openai(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.server.base_url + "/v1",
            api_key=key or self.key,
            timeout=20,
            max_retries=0,
        )

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.server.base_url, api_key=self.key, timeout=20, max_retries=0
        )

    def ollama(self) -> ollama.Client:
        return ollama.Client(
            host=self.server.base_url,
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=20,
        )

    def seen(self, name: str) -> list[dict[str, Any]]:
        """The chat bodies backend `name` received, oldest first."""
        return [
            json.loads(r["body"])
            for r in mock_stats(self.mocks[name])["last_requests"]
            if r["path"] in CHAT_PATHS
        ]


def _prompt_of(body: dict[str, Any]) -> str:
    return prompts.text_of(body["messages"][-1]["content"])


def _is_critique(body: dict[str, Any]) -> bool:
    return "--- Answer " in _prompt_of(body)


def _is_refine(body: dict[str, Any]) -> bool:
    return "\nCritiques:\n" in _prompt_of(body)


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, django_db_blocker: Any) -> Iterator[Gateway]:
    mocks: dict[str, MockBackendProcess] = {}
    server = None
    try:
        for name, (kind, models, extra) in MOCKS.items():
            mocks[name] = start_mock_backend(
                "--kind", kind, "--name", name, "--models", models, *extra
            )
        with django_db_blocker.unblock():
            if SHIPS_TO_REDIS:
                clear_usage_stream()
            for name, (kind, models, _) in MOCKS.items():
                backend = Backend.objects.create(
                    name=name,
                    base_url=mocks[name].base_url,
                    kind=kind,
                    status=HealthStatus.HEALTHY,
                )
                for model in models.split(","):
                    BackendModel.objects.create(
                        backend=backend, name=model, loaded=True
                    )
            Alias.objects.create(name="council", target=f"moe-{MODEL}")
            policy = RoutingPolicy.load()
            policy.ensemble_step_timeout_seconds = STEP_TIMEOUT
            policy.save()
            _, key = ApiKey.objects.create_key("ensemble-tests")
            keys = {
                "plain-only": ApiKey.objects.create_key(
                    "ensemble-plain-only", allowed_models=MODEL
                )[1],
                "moe-and-plain": ApiKey.objects.create_key(
                    "ensemble-moe-and-plain", allowed_models=f"moe-*,{MODEL}"
                )[1],
                "moe-only": ApiKey.objects.create_key(
                    "ensemble-moe-only", allowed_models="moe-*"
                )[1],
                "budget": ApiKey.objects.create_key(
                    "ensemble-budget", budget_tokens=60, budget_period="day"
                )[1],
                "stream-budget": ApiKey.objects.create_key(
                    "ensemble-stream-budget", budget_tokens=60, budget_period="day"
                )[1],
            }
        server = start_nexus_server(NEXUS_BREAKER_FAILURES="1000000")
        yield Gateway(server, mocks, key, keys)
    finally:
        if server is not None:
            server.stop()
        for mock in mocks.values():
            mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture(autouse=True)
def _reset_mocks(gateway: Gateway) -> Iterator[None]:
    yield
    for mock in gateway.mocks.values():
        httpx.post(f"{mock.base_url}/_mock/reset", timeout=5)


def ensemble_records(
    ensemble_id: str, count: int, django_db_blocker: Any
) -> list[UsageRecord]:
    """The usage records of one ensemble, once all `count` are written."""
    deadline = time.monotonic() + 15
    with django_db_blocker.unblock():
        while True:
            if SHIPS_TO_REDIS:
                drain_usage_stream()
            records = list(
                UsageRecord.objects.filter(ensemble_id=ensemble_id).order_by("id")
            )
            if len(records) >= count:
                return records
            assert time.monotonic() < deadline, f"{len(records)} of {count} recorded"
            time.sleep(0.1)


def header_fields(headers: Any) -> dict[str, str]:
    """``x-nexus-ensemble`` as a dict ("opinions" -> "3 of 3", ...)."""
    value = headers["x-nexus-ensemble"]
    return dict(part.strip().split("=", 1) for part in value.split(";"))


def refined_by(backend: str, question: str, model: str = MODEL) -> str:
    return f"[{backend}/{model}] refined: [{backend}/{model}] echo: {question}"


def test_three_backends_answer_critique_and_the_best_refines(
    gateway: Gateway, django_db_blocker: Any
) -> None:
    question = "Which sort is stable? prefer:beta"
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=f"moe-{MODEL}",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": question},
        ],
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == refined_by("beta", question)
    assert reply.model == f"moe-{MODEL}"
    fields = header_fields(raw.headers)
    assert fields["opinions"] == "3 of 3"
    assert fields["answered"] == "3"
    assert fields["critiques"] == "3"
    assert raw.headers["x-nexus-backend"] == "beta"  # the refining backend
    seen = {name: gateway.seen(name) for name in ("alpha", "beta", "gamma")}
    for name, bodies in seen.items():
        answers = [b for b in bodies if not _is_critique(b) and not _is_refine(b)]
        critiques = [b for b in bodies if _is_critique(b)]
        assert len(answers) == 1, name
        assert answers[0]["messages"][-1]["content"] == question
        assert answers[0]["messages"][0]["content"] == "Be brief."
        (critique,) = critiques
        # Each backend critiques the others' answers, never its own.
        text = _prompt_of(critique)
        assert f"[{name}/" not in text
        assert text.count("--- Answer ") == 2
    refines = {name: [b for b in seen[name] if _is_refine(b)] for name in seen}
    assert [len(refines[n]) for n in ("alpha", "beta", "gamma")] == [0, 1, 0]
    (refine,) = refines["beta"]
    assert refine["messages"][0] == {"role": "system", "content": "Be brief."}
    assert f"[beta/{MODEL}] echo: {question}" in _prompt_of(refine)
    assert "Answer " in _prompt_of(refine)  # the others' critiques

    # Usage: every sub-request against the caller's key, under one id.
    ensemble_id = raw.headers["x-nexus-ensemble-id"]
    records = ensemble_records(ensemble_id, 7, django_db_blocker)
    assert len(records) == 7
    (prefix,) = {r.api_key_prefix for r in records}
    assert prefix and gateway.key.startswith(prefix)
    assert {r.requested_model for r in records} == {f"moe-{MODEL}"}
    assert {r.served_model for r in records} == {MODEL}
    assert {r.status for r in records} == {200}
    assert {r.endpoint for r in records} == {"chat"}
    assert sorted(r.backend for r in records) == sorted(
        ["alpha", "alpha", "beta", "beta", "beta", "gamma", "gamma"]
    )
    assert all(r.total_tokens > 0 for r in records)


def test_the_openai_client_streams_the_refined_answer(gateway: Gateway) -> None:
    question = "Stream it. prefer:alpha"
    with gateway.openai().chat.completions.with_streaming_response.create(
        model=f"moe-{MODEL}",
        messages=[{"role": "user", "content": question}],
        stream=True,
    ) as response:
        assert header_fields(response.headers)["opinions"] == "3 of 3"
        chunks = list(response.parse())
    pieces = [c.choices[0].delta.content for c in chunks if c.choices]
    assert "".join(p or "" for p in pieces) == refined_by("alpha", question)
    assert len([p for p in pieces if p]) > 1  # streamed, not one block
    assert {c.model for c in chunks} == {f"moe-{MODEL}"}


def test_the_anthropic_client_gets_one_message(gateway: Gateway) -> None:
    question = "Explain briefly. prefer:gamma"
    message = gateway.anthropic().messages.create(
        model=f"moe-{MODEL}",
        max_tokens=200,
        messages=[{"role": "user", "content": question}],
    )
    assert message.type == "message"
    assert message.model == f"moe-{MODEL}"
    assert message.content[0].text == refined_by("gamma", question)  # type: ignore[union-attr]
    assert len([b for b in gateway.seen("gamma") if _is_refine(b)]) == 1

    with gateway.anthropic().messages.stream(
        model=f"moe-{MODEL}",
        max_tokens=200,
        messages=[{"role": "user", "content": question + " again"}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == refined_by("gamma", question + " again")
    assert final.stop_reason == "end_turn"


def test_the_ollama_client_chats_with_an_ensemble(gateway: Gateway) -> None:
    question = "Say it. prefer:beta"
    client = gateway.ollama()
    reply = client.chat(
        model=f"moe-{MODEL}", messages=[{"role": "user", "content": question}]
    )
    assert reply.message.content == refined_by("beta", question)
    assert reply.model == f"moe-{MODEL}"
    pieces = [
        part.message.content or ""
        for part in client.chat(
            model=f"moe-{MODEL}",
            messages=[{"role": "user", "content": question}],
            stream=True,
        )
    ]
    assert "".join(pieces) == refined_by("beta", question)
    generated = client.generate(model=f"moe-{MODEL}", prompt=question)
    assert generated.response == refined_by("beta", question)


def test_an_alias_of_an_ensemble_is_an_ensemble(gateway: Gateway) -> None:
    question = "Through an alias. prefer:gamma"
    reply = gateway.openai().chat.completions.create(
        model="council", messages=[{"role": "user", "content": question}]
    )
    assert reply.choices[0].message.content == refined_by("gamma", question)
    assert reply.model == "council"


def test_unreadable_critiques_choose_the_first_answer(gateway: Gateway) -> None:
    question = "Anything. garble"
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=f"moe-{MODEL}", messages=[{"role": "user", "content": question}]
    )
    fields = header_fields(raw.headers)
    assert fields["critiques"] == "0"
    assert fields["best"] == "1"
    assert (
        raw.parse()
        .choices[0]
        .message.content.startswith(  # type: ignore[union-attr]
            "["
        )
    )
    assert " refined: " in (raw.parse().choices[0].message.content or "")


def test_a_failing_backend_does_not_fail_the_ensemble(
    gateway: Gateway, django_db_blocker: Any
) -> None:
    question = "Will it boom? prefer:alpha"
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=f"moe-{MODEL}", messages=[{"role": "user", "content": question}]
    )
    assert raw.parse().choices[0].message.content == refined_by("alpha", question)
    fields = header_fields(raw.headers)
    assert fields["opinions"] == "3 of 3"
    assert fields["answered"] == "2"
    # gamma failed its answer, so it was not asked to critique.
    assert [_is_critique(b) for b in gateway.seen("gamma")] == [False]
    records = ensemble_records(raw.headers["x-nexus-ensemble-id"], 6, django_db_blocker)
    # 3 answers (one failed), 2 critiques, 1 refinement.
    assert sorted(r.status for r in records) == [200] * 5 + [500]
    assert [r.backend for r in records if r.status == 500] == ["gamma"]


def test_when_every_opinion_fails_the_client_gets_its_surfaces_error(
    gateway: Gateway,
) -> None:
    messages = [{"role": "user", "content": "allfailboom"}]
    with pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().chat.completions.create(
            model=f"moe-{MODEL}", messages=messages
        )
    assert caught.value.status_code == 502
    body = caught.value.response.json()
    assert body["error"]["code"] == "ensemble_failed"
    assert (
        f"No backend gave an opinion for model 'moe-{MODEL}'"
        in (body["error"]["message"])
    )
    for name in ("alpha", "beta", "gamma"):
        assert body["error"]["message"].count(f"{name}:") == 1
    with pytest.raises(anthropic.APIStatusError) as refused:
        gateway.anthropic().messages.create(
            model=f"moe-{MODEL}",
            max_tokens=50,
            messages=messages,  # type: ignore[arg-type]
        )
    assert refused.value.status_code == 502
    shape = refused.value.response.json()
    assert (
        shape["type"] == "error"
        and "No backend gave an opinion" in (shape["error"]["message"])
    )


def test_with_one_backend_its_answer_is_the_answer(
    gateway: Gateway, django_db_blocker: Any
) -> None:
    question = "Alone? prefer:alpha"
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="moe-solo:1b", messages=[{"role": "user", "content": question}]
    )
    assert raw.parse().choices[0].message.content == (
        f"[alpha/solo:1b] echo: {question}"
    )
    assert header_fields(raw.headers) == {"opinions": "1 of 3", "answered": "1"}
    assert len(gateway.seen("alpha")) == 1  # no critique, no refinement
    (record,) = ensemble_records(
        raw.headers["x-nexus-ensemble-id"], 1, django_db_blocker
    )
    assert (record.backend, record.served_model) == ("alpha", "solo:1b")
    stream = gateway.openai().chat.completions.create(
        model="moe-solo:1b",
        messages=[{"role": "user", "content": question}],
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == f"[alpha/solo:1b] echo: {question}"
    assert len([p for p in pieces if p]) > 1


def test_a_lone_failing_backend_fails_in_the_ollama_shape(gateway: Gateway) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        gateway.ollama().chat(
            model="moe-broken:1b", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 502
    assert "No backend gave an opinion for model 'moe-broken:1b'" in str(
        caught.value.error
    )


def test_allow_lists_apply_to_the_ensemble_and_its_model(gateway: Gateway) -> None:
    messages = [{"role": "user", "content": "allowed?"}]
    for name in ("plain-only", "moe-only"):
        with pytest.raises(openai.PermissionDeniedError) as caught:
            gateway.openai(gateway.keys[name]).chat.completions.create(
                model=f"moe-{MODEL}",
                messages=messages,  # type: ignore[arg-type]
            )
        assert caught.value.code == "model_not_allowed"
    reply = gateway.openai(gateway.keys["moe-and-plain"]).chat.completions.create(
        model=f"moe-{MODEL}",
        messages=messages,  # type: ignore[arg-type]
    )
    assert " refined: " in (reply.choices[0].message.content or "")
    assert gateway.seen("alpha") != []


def test_an_unknown_model_is_404_and_tools_are_refused(gateway: Gateway) -> None:
    client = gateway.openai()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="moe-nothing:1b", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=f"moe-{MODEL}",
            messages=[{"role": "user", "content": "x"}],
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object"}},
                }
            ],
        )
    assert caught.value.param == "tools"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=f"moe-{MODEL}", input="x")
    assert all(gateway.seen(name) == [] for name in ("alpha", "beta", "gamma"))


def test_the_budget_is_charged_for_every_step(gateway: Gateway) -> None:
    """One ensemble spends its seven steps' tokens: more than the key's budget
    of 60, which a single request of this size would not have used up."""
    client = gateway.openai(gateway.keys["budget"])
    messages = [{"role": "user", "content": "budget check prefer:beta"}]
    client.chat.completions.create(model=f"moe-{MODEL}", messages=messages)  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    assert caught.value.code == "budget_exceeded"


def test_the_streamed_refinement_is_cut_when_the_budget_runs_out(
    gateway: Gateway, django_db_blocker: Any
) -> None:
    """The last step streams under the same budget meter as any stream,
    counting what the earlier steps spent: past the key's budget of 60 tokens
    it is cut after the event that crossed, with the budget's error."""
    for mock in gateway.mocks.values():
        httpx.post(
            f"{mock.base_url}/_mock/config", json={"chunks": 40}, timeout=5
        ).raise_for_status()
    question = "A long stream on a small budget. prefer:alpha"
    with httpx.stream(
        "POST",
        f"{gateway.server.base_url}/v1/chat/completions",
        headers={"authorization": f"Bearer {gateway.keys['stream-budget']}"},
        json={
            "model": f"moe-{MODEL}",
            "messages": [{"role": "user", "content": question}],
            "stream": True,
        },
        timeout=20,
    ) as answer:
        assert answer.status_code == 200
        body = answer.read().decode()
        ensemble_id = answer.headers["x-nexus-ensemble-id"]
    events = [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]
    *chunks, last = events
    assert last["error"]["code"] == "budget_exceeded"
    assert last["error"]["type"] == "insufficient_quota"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text and len(text) < len(refined_by("alpha", question))
    records = ensemble_records(ensemble_id, 7, django_db_blocker)
    (cut,) = [r for r in records if r.error == "budget_exceeded"]
    assert cut.streamed and cut.status == 200 and cut.backend == "alpha"
    # The meter counted the cut stream as relayed: at least a token an event.
    assert cut.completion_tokens >= len(chunks) - 1


def _fail_refinements(gateway: Gateway, *names: str) -> None:
    for name in names:
        httpx.post(
            f"{gateway.mocks[name].base_url}/_mock/config",
            json={"fail_on_text": "Critiques:"},
            timeout=5,
        ).raise_for_status()


def test_a_failed_refinement_goes_to_the_next_best_backend(gateway: Gateway) -> None:
    _fail_refinements(gateway, "beta")
    question = "Refine elsewhere. prefer:beta"
    reply = gateway.openai().chat.completions.create(
        model=f"moe-{MODEL}", messages=[{"role": "user", "content": question}]
    )
    text = reply.choices[0].message.content or ""
    refiner = text.split("/", 1)[0].removeprefix("[")
    assert refiner in ("alpha", "gamma")
    assert text == f"[{refiner}/{MODEL}] refined: [beta/{MODEL}] echo: {question}"


def test_when_no_backend_refines_the_best_answer_is_sent_as_it_was(
    gateway: Gateway,
) -> None:
    _fail_refinements(gateway, "alpha", "beta", "gamma")
    question = "Nobody refines. prefer:beta"
    stream = gateway.openai().chat.completions.create(
        model=f"moe-{MODEL}",
        messages=[{"role": "user", "content": question}],
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == f"[beta/{MODEL}] echo: {question}"


def test_a_backend_slower_than_the_step_timeout_is_left_out(
    gateway: Gateway, django_db_blocker: Any
) -> None:
    httpx.post(
        f"{gateway.mocks['gamma'].base_url}/_mock/config",
        json={"latency_ms": STEP_TIMEOUT * 1000 * 4},
        timeout=5,
    ).raise_for_status()
    question = "Too slow? prefer:alpha"
    started = time.monotonic()
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=f"moe-{MODEL}", messages=[{"role": "user", "content": question}]
    )
    assert time.monotonic() - started < STEP_TIMEOUT * 3
    assert raw.parse().choices[0].message.content == refined_by("alpha", question)
    assert header_fields(raw.headers)["answered"] == "2"
    records = ensemble_records(raw.headers["x-nexus-ensemble-id"], 6, django_db_blocker)
    (late,) = [r for r in records if r.backend == "gamma" or r.status != 200]
    assert (late.status, late.error) == (504, "ensemble_step_timeout")


def test_a_client_that_hangs_up_cancels_every_step(
    gateway: Gateway, django_db_blocker: Any
) -> None:
    for mock in gateway.mocks.values():
        httpx.post(
            f"{mock.base_url}/_mock/config", json={"latency_ms": 30_000}, timeout=5
        ).raise_for_status()
    request_id = "ensemble-hang-up"
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{gateway.server.base_url}/v1/chat/completions",
            headers={
                "authorization": f"Bearer {gateway.key}",
                "x-request-id": request_id,
            },
            json={
                "model": f"moe-{MODEL}",
                "messages": [{"role": "user", "content": "hi"}],
            },
            timeout=1.0,
        )
    deadline = time.monotonic() + 15
    with django_db_blocker.unblock():
        while True:
            if SHIPS_TO_REDIS:
                drain_usage_stream()
            records = list(UsageRecord.objects.filter(request_id=request_id))
            if len(records) >= 3:
                break
            assert time.monotonic() < deadline, f"{len(records)} recorded"
            time.sleep(0.1)
    # Three answers asked for, none given: nothing billed.
    assert len(records) == 3
    assert {(r.status, r.error) for r in records} == {(499, "client_closed")}
    assert {r.total_tokens for r in records} == {0}
    assert len({r.ensemble_id for r in records}) == 1
    # The backends saw their requests go: nothing is left in flight.
    for name in ("alpha", "beta", "gamma"):
        while mock_stats(gateway.mocks[name])["in_flight"]:
            assert time.monotonic() < deadline, f"{name} still busy"
            time.sleep(0.05)


def test_the_responses_api_gets_the_refined_answer(gateway: Gateway) -> None:
    question = "Respond. prefer:gamma"
    response = gateway.openai().responses.create(model=f"moe-{MODEL}", input=question)
    assert response.output_text == refined_by("gamma", question)


def test_loading_and_counting_tokens_know_ensembles(gateway: Gateway) -> None:
    """Ollama's "load the model" (what ``ollama run`` sends first) and
    Anthropic's count_tokens answer for a moe- name without a backend."""
    loaded = gateway.ollama().chat(model=f"moe-{MODEL}", messages=[])
    assert loaded.done_reason == "load"
    counted = gateway.anthropic().messages.count_tokens(
        model=f"moe-{MODEL}", messages=[{"role": "user", "content": "count me"}]
    )
    assert counted.input_tokens > 0
    assert all(gateway.seen(name) == [] for name in ("alpha", "beta", "gamma"))
    with pytest.raises(ollama.ResponseError) as caught:
        gateway.ollama().chat(model="moe-nothing:1b", messages=[])
    assert caught.value.status_code == 404


def test_a_killed_process_leaves_its_steps_recorded_lost_in_one_ensemble(
    gateway: Gateway, django_db_blocker: Any
) -> None:
    """kill -9 of the serving process while three answers are asked for: the
    reconciled records of the steps still share the ensemble's id."""
    for mock in gateway.mocks.values():
        httpx.post(
            f"{mock.base_url}/_mock/config", json={"latency_ms": 30_000}, timeout=5
        ).raise_for_status()
    doomed = start_nexus_server(
        NEXUS_BREAKER_FAILURES="1000000",
        NEXUS_USAGE_FLUSH_INTERVAL="0.1",
        NEXUS_USAGE_PROGRESS_INTERVAL="0.2",
    )
    request_id = "ensemble-killed"

    def ask() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{doomed.base_url}/v1/chat/completions",
                headers={
                    "authorization": f"Bearer {gateway.key}",
                    "x-request-id": request_id,
                },
                json={
                    "model": f"moe-{MODEL}",
                    "messages": [{"role": "user", "content": "hi"}],
                },
                timeout=30,
            )

    asking = threading.Thread(target=ask)
    asking.start()
    try:
        with django_db_blocker.unblock():

            def opened() -> bool:
                if SHIPS_TO_REDIS:
                    drain_usage_stream()
                rows = OpenRequest.objects.filter(request_id=request_id)
                return rows.count() == 3

            wait_until(opened, what="the three answers to be open")
            doomed.process.kill()
            doomed.process.wait(timeout=10)
            reconcile_lost_usage(lost_after=0)
            records = list(UsageRecord.objects.filter(request_id=request_id))
    finally:
        doomed.stop()
        asking.join(timeout=35)
    assert len(records) == 3
    assert all(r.reconciled and r.error == LOST_ERROR for r in records)
    (ensemble_id,) = {r.ensemble_id for r in records}
    assert ensemble_id


def test_model_lists_show_an_ensemble_for_models_with_two_backends(
    gateway: Gateway,
) -> None:
    """What Open WebUI and the SDKs list is what they offer: moe-llama3:8b (three
    backends), not moe-solo:1b (one backend: no other opinion), for keys
    allowed both the ensemble and its model."""
    listed = {m.id: m for m in gateway.openai().models.list()}
    assert listed[f"moe-{MODEL}"].owned_by == f"ensemble:{MODEL}"
    assert "moe-solo:1b" not in listed and "moe-broken:1b" not in listed
    tags = {m.model for m in gateway.ollama().list().models}
    assert {MODEL, f"moe-{MODEL}"} <= tags and "moe-solo:1b" not in tags
    shown = gateway.ollama().show(f"moe-{MODEL}")
    assert "tools" not in (shown.capabilities or [])
    # A listed name answers.
    reply = gateway.ollama().chat(
        model=f"moe-{MODEL}", messages=[{"role": "user", "content": "listed"}]
    )
    assert "refined" in (reply.message.content or "")
    models = gateway.openai(gateway.keys["moe-and-plain"]).models.retrieve(
        f"moe-{MODEL}"
    )
    assert models.id == f"moe-{MODEL}"
    for key in ("plain-only", "moe-only"):
        ids = {m.id for m in gateway.openai(gateway.keys[key]).models.list()}
        assert f"moe-{MODEL}" not in ids, key
        with pytest.raises(openai.NotFoundError):
            gateway.openai(gateway.keys[key]).models.retrieve(f"moe-{MODEL}")
    anthropic_ids = {m.id for m in gateway.anthropic().models.list()}
    assert f"moe-{MODEL}" in anthropic_ids


def test_one_opinion_lists_no_ensembles() -> None:
    policy = EnsemblePolicy(opinions=1)
    backends = [
        BackendSpec(
            name, f"http://{name}", status="healthy", models=(ModelSpec(MODEL),)
        )
        for name in ("a", "b")
    ]
    routes = RouterSnapshot.build(backends=backends)
    assert listed_ensembles(routes) == {f"moe-{MODEL}": MODEL}
    one = RouterSnapshot.build(
        backends=backends, policy=replace(routes.policy, ensemble=policy)
    )
    assert listed_ensembles(one) == {}
