"""`kill -9` of a serving process under `nexus_run`: no admitted request goes
unrecorded (issue 27, item 4).

Real processes: `nexus_run --web-only --workers 2` on the test's database (and
Redis in production mode), a slow mock backend whose streams last seconds, a
client per request. The test plays Celery beat: it drains the stream and
reconciles, as the beat tasks do.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import REPO_ROOT, MockBackendProcess, server_env, wait_until
from usage.lost import LOST_ERROR, reconcile_lost_usage
from usage.models import ApiKey, OpenRequest, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

pytestmark = pytest.mark.django_db(transaction=True)

SHIPS_TO_REDIS = settings.NEXUS_USAGE_TRANSPORT == "redis"
STREAMS = 12
# The test's own reconciliation: the survivor beats every 0.2 s.
LOST_AFTER = 5.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Running:
    process: subprocess.Popen[str]
    port: int
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def expect(self, pattern: str, timeout: float) -> re.Match[str]:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            for line in self.seen:
                if match := regex.search(line):
                    return match
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in:\n" + "".join(self.seen)
            with contextlib.suppress(queue.Empty):
                self.seen.append(self.lines.get(timeout=min(left, 0.5)))

    def stop(self) -> int:
        """Ctrl-C: the launcher stops its children (they have sessions of their own)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise

    def queued_in_admission(self) -> float:
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        found = re.findall(
            r"^nexus_admission_queue_length\{[^}]*\} (\S+)$", text, re.MULTILINE
        )
        return sum(float(value) for value in found)


@pytest.fixture
def nexus_run(
    tmp_path: Path, shared_redis_env: dict[str, str]
) -> Iterator[Callable[[], Running]]:
    started: list[Running] = []
    # The embedded default: two serving processes need a Redis to share (else
    # `--web-only` serves with one); usage still goes the database's way, which
    # this test process reads, as it does without nexus_run.
    shared = shared_redis_env | (
        {"NEXUS_USAGE_TRANSPORT": "database"} if shared_redis_env else {}
    )

    def start() -> Running:
        env = (
            server_env()
            | shared
            | {
                "NEXUS_STATE_DIR": str(tmp_path / "state"),
                "NEXUS_DEMO": "0",
                "NEXUS_USAGE_PROGRESS_INTERVAL": "0.2",
                "NEXUS_DRAIN_SECONDS": "10",
            }
        )
        env.pop("NEXUS_ADMIN_PASSWORD", None)
        port = _free_port()
        process = subprocess.Popen(
            [sys.executable, "manage.py", "nexus_run", "--port", str(port)]
            + ["--workers", "2", "--web-only"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        running = Running(process, port)

        def pump() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                running.lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


def _connections(pid: int, port: int) -> int:
    """Established client connections on `port` that process `pid` holds."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
            inodes.add(f"socket:[{inode}]")
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            held += os.readlink(fd) in inodes
    return held


@dataclass
class Outcome:
    status: int | None = None
    chunks: int = 0
    done: bool = False
    error: str = ""


def _stream(base: str, key: str, request_id: str, outcome: Outcome) -> None:
    body = {
        "model": "llama3:8b",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "stream": True,
    }
    headers = {"authorization": f"Bearer {key}", "x-request-id": request_id}
    try:
        with (
            httpx.Client(timeout=60) as client,
            client.stream(
                "POST", f"{base}/v1/chat/completions", json=body, headers=headers
            ) as response,
        ):
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = response.read().decode()
                return
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    outcome.chunks += 1
                elif line == "data: [DONE]":
                    outcome.done = True
    except httpx.HTTPError as error:
        outcome.error = repr(error)


def _settle_usage() -> None:
    """What Celery beat does: drain the stream, record the dead's requests lost."""
    if SHIPS_TO_REDIS:
        drain_usage_stream()
    reconcile_lost_usage(lost_after=LOST_AFTER)


def _records_of(request_ids: list[str]) -> dict[str, UsageRecord]:
    _settle_usage()
    return {
        record.request_id: record
        for record in UsageRecord.objects.filter(request_id__in=request_ids)
    }


def test_kill_9_of_a_serving_process_leaves_a_record_of_every_admitted_request(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_run: Callable[[], Running],
) -> None:
    if SHIPS_TO_REDIS:
        clear_usage_stream()
    # Streams of 100 chunks 40 ms apart (4 s); the backend takes 4 at once, so
    # admission queues the rest.
    slow = mock_backend_factory(
        "--models", "llama3:8b", "--name", "slow", "--chunks", "100",
        "--chunk-delay-ms", "40",
    )  # fmt: skip
    fast = mock_backend_factory("--models", "mistral:7b", "--name", "fast")
    backend = Backend.objects.create(
        name="slow",
        base_url=slow.base_url,
        status=HealthStatus.HEALTHY,
        max_concurrency=4,
    )
    BackendModel.objects.create(backend=backend, name="llama3:8b")
    other = Backend.objects.create(
        name="fast", base_url=fast.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=other, name="mistral:7b")
    _, key = ApiKey.objects.create_key("sigkill")
    _, limited = ApiKey.objects.create_key("sigkill-rpm", rpm_limit=1)

    nexus = nexus_run()
    pids = nexus.expect(r"on one port \(pids (\d+), (\d+)\)", timeout=90)
    for web in ("web-1", "web-2"):  # both accept connections
        nexus.expect(rf"\[{web}\] .* Listening on TCP address", timeout=60)

    # Refusals are requests too: one key's 429s.
    refused = [f"rpm-{i}" for i in range(5)]
    statuses = [
        httpx.post(
            f"{nexus.base}/v1/chat/completions",
            json={
                "model": "mistral:7b",
                "messages": [{"role": "user", "content": "x"}],
            },
            headers={"authorization": f"Bearer {limited}", "x-request-id": rid},
            timeout=30,
        ).status_code
        for rid in refused
    ]
    assert 429 in statuses

    request_ids = [f"stream-{i}" for i in range(STREAMS)]
    outcomes = {rid: Outcome() for rid in request_ids}
    threads = [
        threading.Thread(target=_stream, args=(nexus.base, key, rid, outcome))
        for rid, outcome in outcomes.items()
    ]
    for thread in threads:
        thread.start()

    def all_admitted() -> bool:
        answering = sum(outcome.chunks > 0 for outcome in outcomes.values())
        # In production a backend's slots are shared through Redis: a process
        # may refuse (503 backends_busy) what its admission share let through.
        refused = sum(o.status not in (None, 200) for o in outcomes.values())
        queued = nexus.queued_in_admission()
        return answering > 0 and answering + refused + queued == STREAMS

    wait_until(all_admitted, 30, "every stream answering or queued in admission")

    def streams_reported() -> bool:
        # Every answering stream's progress (backend, tokens so far) handed on.
        if SHIPS_TO_REDIS:
            drain_usage_stream()
        reported = set(
            OpenRequest.objects.filter(completion_tokens__gt=0).values_list(
                "request_id", flat=True
            )
        )
        return all(
            outcome.done or rid in reported
            for rid, outcome in outcomes.items()
            if outcome.chunks > 0
        )

    wait_until(streams_reported, 30, "the answering streams' progress")
    # The process that holds more of the streams' connections.
    victim = max(
        (int(pid) for pid in pids.groups()),
        key=lambda pid: _connections(pid, nexus.port),
    )
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)

    # The gateway keeps answering (on the other process) ...
    answered = [
        httpx.post(
            f"{nexus.base}/v1/chat/completions",
            json={
                "model": "mistral:7b",
                "messages": [{"role": "user", "content": "y"}],
            },
            headers={"authorization": f"Bearer {key}", "x-request-id": f"after-{i}"},
            timeout=30,
        ).status_code
        for i in range(5)
    ]
    assert answered == [200] * 5
    # ... and the killed one is back within 5 s.
    nexus.expect(r"restarted \(pid \d+\)", timeout=5 - (time.monotonic() - killed_at))

    for thread in threads:
        thread.join(timeout=120)
    cut = [rid for rid, o in outcomes.items() if o.status == 200 and not o.done]
    unanswered = [rid for rid, o in outcomes.items() if o.status is None]
    completed = [rid for rid, o in outcomes.items() if o.done]
    assert cut, (outcomes, "".join(nexus.seen[-60:]))  # streams mid-answer
    # In production the dead process's backend slots stay leased for a while
    # (usage/limits): the survivor may refuse some of the queued (503), as may
    # either process before (above).
    refused_later = {
        rid: o.status for rid, o in outcomes.items() if o.status not in (None, 200)
    }
    assert len(cut) + len(unanswered) + len(completed) + len(refused_later) == STREAMS

    everything = request_ids + refused + [f"after-{i}" for i in range(5)]
    records = wait_until(
        lambda: (found := _records_of(everything)).keys() == set(everything) and found,
        60,
        "a usage record of every request",
    )
    assert UsageRecord.objects.filter(request_id__in=everything).count() == len(
        everything
    )
    for rid in cut:
        record = records[rid]
        assert record.reconciled and record.error == LOST_ERROR, rid
        assert (record.status, record.backend, record.streamed) == (200, "slow", True)
        assert record.completion_tokens > 0 and record.is_error
    for rid in unanswered:
        record = records[rid]
        assert record.reconciled and record.error == LOST_ERROR, rid
        assert (record.status, record.backend, record.total_tokens) == (0, "", 0)
    for rid in completed:
        record = records[rid]
        assert not record.reconciled and record.status == 200 and not record.error
    for rid, status in refused_later.items():
        record = records[rid]
        assert not record.reconciled and record.status == status
    assert [records[rid].status for rid in refused] == statuses
    assert not OpenRequest.objects.exists()


def test_requests_refused_while_draining_are_recorded(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_run: Callable[[], Running],
) -> None:
    if SHIPS_TO_REDIS:
        clear_usage_stream()
    slow = mock_backend_factory(
        "--models", "llama3:8b", "--name", "slow", "--chunks", "100",
        "--chunk-delay-ms", "40",
    )  # fmt: skip
    backend = Backend.objects.create(
        name="slow", base_url=slow.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name="llama3:8b")
    _, key = ApiKey.objects.create_key("draining")
    nexus = nexus_run()
    nexus.expect(r"on one port \(pids (\d+), (\d+)\)", timeout=90)
    outcome = Outcome()
    streaming = threading.Thread(
        target=_stream, args=(nexus.base, key, "long", outcome)
    )
    streaming.start()
    wait_until(lambda: outcome.chunks > 0, 30, "the stream answering")

    os.killpg(nexus.process.pid, signal.SIGINT)  # Ctrl-C: every process drains
    refused: list[str] = []
    attempts = itertools.count()

    def shutting_down() -> bool:
        rid = f"late-{next(attempts)}"
        try:
            response = httpx.post(
                f"{nexus.base}/v1/chat/completions",
                json={
                    "model": "llama3:8b",
                    "messages": [{"role": "user", "content": "z"}],
                },
                headers={"authorization": f"Bearer {key}", "x-request-id": rid},
                timeout=30,
            )
        except httpx.TransportError:
            return False
        if response.status_code == 200 and not refused:
            return False  # sent before the process heard of the Ctrl-C
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "shutting_down"
        refused.append(rid)
        return len(refused) >= 3

    wait_until(shutting_down, 30, "three requests refused while draining")
    assert nexus.process.wait(timeout=60) == 0
    streaming.join(timeout=30)
    assert outcome.done

    if SHIPS_TO_REDIS:
        drain_usage_stream()
    records = {
        r.request_id: r for r in UsageRecord.objects.filter(request_id__in=refused)
    }
    assert sorted(records) == sorted(refused)
    for record in records.values():
        assert (record.status, record.error) == (503, "shutting_down")
    assert UsageRecord.objects.get(request_id="long").status == 200
