"""Batch jobs end to end: the official SDKs, Daphne serving Nexus, a Celery
worker running the batches, mock backends as real processes.

One server, one worker and three mocks serve the module: "fast" (models m,
emb and other, no latency), "slow" (model slow, 60 ms a request: batches long
enough to cancel or kill mid-run) and "slotted" (model slot, 2 slots, the
backend's max_concurrency 2: the order test). The worker runs with a 2 s
lease, so a killed worker's batch is resumed within seconds.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from django.conf import settings
from django.core.management import call_command
from django.utils import timezone

from backends.models import Backend, BackendModel, HealthStatus
from tests import zygote
from tests.conftest import (
    REPO_ROOT,
    MockBackendProcess,
    NexusServer,
    mock_stats,
    server_env,
    start_mock_backend,
    start_nexus_server,
    wait_until,
)
from usage.models import ApiKey, Batch, ModelPrice, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

SHIPS_TO_REDIS = settings.NEXUS_USAGE_TRANSPORT == "redis"


class Worker:
    """A Celery worker consuming this module's batch queue."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.log: list[str] = []
        self.process = self._start()

    def _start(self) -> Any:
        command = [
            sys.executable, "-m", "celery", "-A", "nexus_site", "worker",
            "--queues", self.env["NEXUS_BATCH_QUEUE"], "--pool", "threads",
            "--concurrency", "3", "--without-mingle", "--without-gossip",
            "--loglevel", "INFO", "--hostname", f"{uuid.uuid4().hex[:8]}@test",
        ]  # fmt: skip
        process = zygote.Popen(
            command,
            cwd=REPO_ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        log = self.log = []

        def drain() -> None:
            assert process.stdout is not None
            log.extend(process.stdout)

        threading.Thread(target=drain, daemon=True).start()
        wait_until(
            lambda: (
                any(" ready." in line for line in log) or process.poll() is not None
            ),
            60,
            "the Celery worker",
        )
        assert process.poll() is None, "".join(log)
        return process

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def restart(self) -> None:
        self.process = self._start()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Setup:
    server: NexusServer
    worker: Worker
    fast: MockBackendProcess
    slow: MockBackendProcess
    slotted: MockBackendProcess
    state: Path
    keys: dict[str, str] = field(default_factory=dict)
    prefixes: dict[str, str] = field(default_factory=dict)

    def openai(self, key: str = "main") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.server.base_url}/v1",
            api_key=self.keys[key],
            max_retries=0,
            timeout=30,
        )

    def anthropic(self, key: str = "main") -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.server.base_url,
            api_key=self.keys[key],
            max_retries=0,
            timeout=30,
        )


_blocker: Any = None


@pytest.fixture(scope="module")
def setup(
    django_db_setup: None, django_db_blocker: Any, tmp_path_factory: Any
) -> Iterator[Setup]:
    global _blocker
    _blocker = django_db_blocker
    started: list[Any] = []
    try:
        fast = start_mock_backend("--models", "m,emb,other", "--name", "b-fast")
        started.append(fast)
        slow = start_mock_backend(
            "--models", "slow", "--name", "b-slow", "--latency-ms", "60"
        )
        started.append(slow)
        slotted = start_mock_backend(
            "--models", "slot", "--name", "b-slot", "--slots", "2",
            "--record-requests", "200",
        )  # fmt: skip
        started.append(slotted)
        keys: dict[str, str] = {}
        prefixes: dict[str, str] = {}
        with django_db_blocker.unblock():
            if SHIPS_TO_REDIS:
                clear_usage_stream()
            for mock, models, capacity in (
                (fast, ("m", "emb", "other"), None),
                (slow, ("slow",), None),
                (slotted, ("slot",), 2),
            ):
                backend = Backend.objects.create(
                    name=mock.base_url.rsplit(":", 1)[1] + "-b",
                    base_url=mock.base_url,
                    status=HealthStatus.HEALTHY,
                    max_concurrency=capacity,
                )
                for model in models:
                    BackendModel.objects.create(backend=backend, name=model)
            ModelPrice.objects.create(
                model="m",
                input_per_million=Decimal(1000),
                output_per_million=Decimal(1000),
                batch_price_factor=Decimal("0.5"),
            )
            specs: dict[str, dict[str, Any]] = {
                "main": {},
                "listed": {"allowed_models": "m"},
                "budget": {"budget_tokens": 150, "budget_period": "day"},
                "interactive": {},
                "other": {},
            }
            for name, limits in specs.items():
                key, raw = ApiKey.objects.create_key(f"batch-{name}", **limits)
                keys[name], prefixes[name] = raw, key.prefix
        state = tmp_path_factory.mktemp("batch-state")
        env = {
            "NEXUS_STATE_DIR": str(state),
            "NEXUS_BATCH_QUEUE": f"batches-{uuid.uuid4().hex[:8]}",
            "NEXUS_BATCH_LEASE_SECONDS": "2",
            "NEXUS_BATCH_CONCURRENCY": "8",
            "NEXUS_BATCH_RUNNING": "4",
            "NEXUS_BATCH_KEY_BATCHES": "4",
        }
        server = start_nexus_server(**env)
        started.append(server)
        worker = Worker(
            server_env() | env | {"NEXUS_BATCH_GATEWAY_URL": server.base_url}
        )
        started.append(worker)
        yield Setup(server, worker, fast, slow, slotted, state, keys, prefixes)
    finally:
        for process in reversed(started):
            process.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def chat_lines(count: int, model: str = "m", **body: Any) -> bytes:
    lines = [
        {
            "custom_id": f"req-{index}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"line {index}"}],
                **body,
            },
        }
        for index in range(count)
    ]
    return "\n".join(json.dumps(line) for line in lines).encode() + b"\n"


def wait_for_end(client: openai.OpenAI, batch_id: str, timeout: float = 90) -> Any:
    ended = ("completed", "failed", "expired", "cancelled")
    return wait_until(
        lambda: (batch := client.batches.retrieve(batch_id)).status in ended and batch,
        timeout,
        f"batch {batch_id} to end",
    )


def wait_for_lines(client: openai.OpenAI, batch_id: str, lines: int) -> None:
    wait_until(
        lambda: client.batches.retrieve(batch_id).request_counts.completed >= lines,
        60,
        f"{lines} lines of {batch_id} to finish",
    )


def results_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_chat_batch(setup: Setup, key: str, data: bytes, **create: Any) -> Any:
    client = setup.openai(key)
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        **create,
    )


def usage_records(batch_id: str, count: int) -> list[UsageRecord]:
    def found() -> list[UsageRecord] | None:
        with _blocker.unblock():
            if SHIPS_TO_REDIS:
                drain_usage_stream()
            records = list(UsageRecord.objects.filter(batch_id=batch_id))
        return records if len(records) >= count else None

    return wait_until(found, 30, "the batch's usage records")


def test_a_200_line_chat_batch_round_trips_through_the_openai_sdk(
    setup: Setup,
) -> None:
    client = setup.openai()
    batch = run_chat_batch(setup, "main", chat_lines(200), metadata={"run": "a"})
    assert batch.status == "validating"
    assert batch.request_counts is not None and batch.request_counts.total == 200
    done = wait_for_end(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts.completed == 200 and done.request_counts.failed == 0
    assert done.error_file_id is None and done.metadata == {"run": "a"}
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    output = results_of(client, done.output_file_id)
    assert sorted(e["custom_id"] for e in output) == sorted(
        f"req-{i}" for i in range(200)
    )
    by_id = {e["custom_id"]: e for e in output}
    reply = by_id["req-7"]["response"]
    assert reply["status_code"] == 200
    assert reply["body"]["choices"][0]["message"]["content"].endswith("line 7")
    assert done.usage is not None and done.usage.input_tokens > 0
    # Listed and shown with the SDK's shapes; the output file is a Files object.
    assert batch.id in [b.id for b in client.batches.list(limit=100)]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    # Every line is a usage record of the owner key, marked and half price.
    records = usage_records(batch.id, 200)
    assert len(records) == 200
    record = records[0]
    assert record.api_key_prefix == setup.prefixes["main"]
    assert record.endpoint == "chat" and record.status == 200
    full = (record.prompt_tokens + record.completion_tokens) * 1_000_000
    assert record.cost_nanos == round(full * 0.5)
    assert setup.server.metric("nexus_batch_lines_total", 'outcome="succeeded"') >= 200


def test_embeddings_batches_and_anthropic_message_batches_run(setup: Setup) -> None:
    client = setup.openai()
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "emb", "input": f"text {i}"},
        }
        for i in range(5)
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    uploaded = client.files.create(file=("e.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data) and uploaded.purpose == "batch"
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    messages = setup.anthropic()
    message_batch = messages.messages.batches.create(
        requests=[
            {
                "custom_id": f"a{i}",
                "params": {
                    "model": "m",
                    "max_tokens": 16,
                    "messages": [{"role": "user", "content": f"hello {i}"}],
                },
            }
            for i in range(3)
        ]
    )
    assert message_batch.processing_status == "in_progress"
    assert message_batch.request_counts.processing == 3
    done = wait_for_end(client, batch.id)
    output = results_of(client, done.output_file_id)
    assert len(output) == 5
    assert output[0]["response"]["body"]["data"][0]["embedding"]
    ended = wait_until(
        lambda: (
            (
                b := messages.messages.batches.retrieve(message_batch.id)
            ).processing_status
            == "ended"
            and b
        ),
        60,
    )
    assert ended.request_counts.succeeded == 3 and ended.results_url
    results = {r.custom_id: r for r in messages.messages.batches.results(ended.id)}
    assert set(results) == {"a0", "a1", "a2"}
    result = results["a1"].result
    assert result.type == "succeeded"
    assert result.message.content[0].text.endswith("hello 1")
    listed = messages.messages.batches.list(limit=10)
    assert message_batch.id in [b.id for b in listed.data]


def test_a_key_without_the_model_gets_a_403_line_each(setup: Setup) -> None:
    client = setup.openai("listed")
    lines = chat_lines(4) + chat_lines(1, model="other").replace(b"req-0", b"no-1")
    done = wait_for_end(client, run_chat_batch(setup, "listed", lines).id)
    assert done.status == "completed"
    assert done.request_counts.completed == 4 and done.request_counts.failed == 1
    errors = results_of(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["no-1"]
    assert errors[0]["response"]["status_code"] == 403
    assert errors[0]["response"]["body"]["error"]["code"] == "model_not_allowed"


def test_a_spent_budget_stops_the_rest_with_budget_exceeded(setup: Setup) -> None:
    client = setup.openai("budget")
    before = mock_stats(setup.fast)["requests"].get("/v1/chat/completions", 0)
    batch = run_chat_batch(setup, "budget", chat_lines(60, max_tokens=4))
    done = wait_for_end(client, batch.id)
    assert done.status == "completed"
    output = results_of(client, done.output_file_id)
    errors = results_of(client, done.error_file_id)
    assert output, "some lines ran before the budget was spent"
    assert len(output) + len(errors) == 60
    codes = {
        (e["error"] or {}).get("code") or e["response"]["body"]["error"]["code"]
        for e in errors
    }
    assert codes == {"budget_exceeded"}
    ran = mock_stats(setup.fast)["requests"].get("/v1/chat/completions", 0) - before
    assert ran < 60  # the rest never reached a backend


def test_cancel_mid_run_starts_no_new_line_and_keeps_finished_ones(
    setup: Setup,
) -> None:
    client = setup.openai("other")
    batch = run_chat_batch(setup, "other", chat_lines(400, model="slow"))
    wait_for_lines(client, batch.id, 16)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait_for_end(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    at_end = mock_stats(setup.slow)["requests"]["/v1/chat/completions"]
    output = results_of(client, done.output_file_id)
    errors = results_of(client, done.error_file_id)
    assert 16 <= len(output) < 400
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    ids = [e["custom_id"] for e in output + errors]
    assert len(ids) == len(set(ids)) == 400
    time.sleep(0.5)  # nothing more may arrive after the end: give it a chance
    assert mock_stats(setup.slow)["requests"]["/v1/chat/completions"] == at_end


def test_interactive_requests_go_ahead_of_queued_batch_lines(setup: Setup) -> None:
    mock = setup.slotted
    # Two slots: the batch may hold one (the other is kept for interactive
    # requests); both wait at the mock until the third request arrives.
    httpx.post(f"{mock.base_url}/_mock/hold", json={"first": 3})
    client = setup.openai("main")
    batch = run_chat_batch(setup, "main", chat_lines(6, model="slot"))
    wait_until(
        lambda: setup.server.metric("nexus_batch_lines_waiting") >= 5,
        60,
        "batch lines waiting in the batch lane",
    )
    interactive = setup.openai("interactive")
    flow = f'flow="{setup.prefixes["interactive"]}"'
    replies: list[Any] = []

    def ask(index: int) -> None:
        replies.append(
            interactive.chat.completions.create(
                model="slot", messages=[{"role": "user", "content": f"now {index}"}]
            )
        )

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for asker in askers:
        asker.start()
    # One interactive request goes through (a slot left), two wait: ahead
    # of the five batch lines waiting since before.
    wait_until(
        lambda: setup.server.metric("nexus_admission_queue_length", flow) >= 2,
        60,
        "interactive requests queued",
    )
    httpx.post(f"{mock.base_url}/_mock/release")
    for asker in askers:
        asker.join(60)
    assert len(replies) == 3
    done = wait_for_end(client, batch.id)
    assert done.request_counts.completed == 6
    bodies = [r["body"] for r in mock_stats(mock)["last_requests"]]
    order = ["now" if "now " in body else "line" for body in bodies]
    # The first batch line, the interactive request that found a slot, then
    # the two that waited, and only then the rest of the batch.
    assert order == [
        "line",
        "now",
        "now",
        "now",
        "line",
        "line",
        "line",
        "line",
        "line",
    ]
    assert (
        setup.server.metric("nexus_admission_band_wait_seconds_count", 'band="batch"')
        >= 5
    )


def test_a_killed_worker_is_resumed_with_each_line_exactly_once(setup: Setup) -> None:
    client = setup.openai("other")
    before = mock_stats(setup.slow)["requests"].get("/v1/chat/completions", 0)
    batch = run_chat_batch(setup, "other", chat_lines(200, model="slow"))
    wait_for_lines(client, batch.id, 40)
    setup.worker.kill()
    with _blocker.unblock():
        killed_at = Batch.objects.get(pk=batch.id)
    assert killed_at.status == "in_progress"
    setup.worker.restart()
    done = wait_for_end(client, batch.id)
    assert done.status == "completed"
    output = results_of(client, done.output_file_id)
    errors = results_of(client, done.error_file_id)
    ids = [e["custom_id"] for e in output + errors]
    assert len(ids) == len(set(ids))
    assert set(ids) == {f"req-{i}" for i in range(200)}
    assert done.request_counts.completed == 200
    # No half-written line was left behind by the kill.
    for path in setup.state.glob("batches/batches/*/*.jsonl"):
        data = path.read_bytes()
        assert not data or data.endswith(b"\n")
    # Completed lines were not sent again: at most those in flight at the kill.
    ran = mock_stats(setup.slow)["requests"]["/v1/chat/completions"] - before
    assert 200 <= ran <= 200 + 8


def test_validation_errors_name_their_lines_in_each_sdks_shape(setup: Setup) -> None:
    client = setup.openai()
    good = json.loads(chat_lines(1).decode())
    bad = b"\n".join(
        [
            json.dumps(good).encode(),
            b"{not json",
            json.dumps(good).encode(),  # the same custom_id again
            json.dumps({**good, "custom_id": "x", "url": "/v1/embeddings"}).encode(),
        ]
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("bad.jsonl", bad), purpose="batch")
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "file"
    message = error["message"]
    assert "Line 2: not valid JSON" in message
    assert "Line 3: custom_id 'req-0' is used twice" in message
    assert "Line 4: every request of a batch must be for the same endpoint" in message
    uploaded = client.files.create(file=("ok.jsonl", chat_lines(2)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as mismatched:
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
    assert "(line 1)" in str(mismatched.value)
    with pytest.raises(openai.NotFoundError):
        setup.openai("other").batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )  # another key's file
    with pytest.raises(anthropic.BadRequestError) as invalid:
        setup.anthropic().messages.batches.create(
            requests=[
                {
                    "custom_id": "ok",
                    "params": {"model": "m", "max_tokens": 5, "messages": []},
                },
                {"custom_id": "no good!", "params": {"model": "m", "messages": []}},
            ]
        )
    body = invalid.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
    assert "requests.1.custom_id must be" in body["error"]["message"]
    assert "requests.1.params.max_tokens: Field required" in body["error"]["message"]
    # An upload without a key is refused at its headers, before its body.
    port = int(setup.server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n"
        )
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 401"), head
    # A batch line's credential that Nexus did not sign is refused.
    forged = httpx.post(
        f"{setup.server.base_url}/v1/chat/completions",
        headers={"X-Nexus-Batch": f"{setup.prefixes['main']}.b.9999999999.{'0' * 64}"},
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert forged.status_code == 401
    assert forged.json()["error"]["code"] == "invalid_api_key"


def test_the_completion_window_ending_expires_the_rest(setup: Setup) -> None:
    client = setup.openai("other")
    batch = run_chat_batch(setup, "other", chat_lines(300, model="slow"))
    wait_for_lines(client, batch.id, 8)
    with _blocker.unblock():
        Batch.objects.filter(pk=batch.id).update(expires_at=timezone.now())
    done = wait_for_end(client, batch.id)
    assert done.status == "expired" and done.expired_at
    output = results_of(client, done.output_file_id)
    errors = results_of(client, done.error_file_id)
    assert 8 <= len(output) < 300
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert len(output) + len(errors) == 300
