"""Graceful shutdown: SIGTERM while streams are in flight loses none and bills all.

Both ways a serving process is run: Daphne started on its own (as the Docker
image starts it, SIGTERM straight from `docker stop`), and `nexus_run` with two
serving processes on one port (SIGTERM to the launcher reaches every child).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from django.conf import settings

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import RoutingPolicy
from tests.conftest import REPO_ROOT, MockBackendProcess, NexusServer, server_env
from tests.gateway.test_metrics import sample
from usage.models import ApiKey, UsageRecord
from usage.stream import clear_usage_stream, drain_usage_stream

pytestmark = pytest.mark.django_db(transaction=True)

STREAMS = 20
# Long enough (4 s) that every stream is still running when SIGTERM arrives,
# even when starting 20 of them takes a loaded machine a few seconds.
CHUNKS = 40
MODEL = "llama3:8b"


def _setup(mock: MockBackendProcess) -> str:
    if settings.NEXUS_USAGE_TRANSPORT == "redis":
        clear_usage_stream()
    backend = Backend.objects.create(
        name="mock-drain", base_url=mock.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name=MODEL)
    # The mock serves every stream at once, as a batching server does: the
    # operator sets the admission watermark to match, so that all the streams
    # (and the ones nexus_run's second test adds) are in flight at SIGTERM.
    policy = RoutingPolicy.load()
    policy.admission_watermark_per_backend = 2 * STREAMS
    policy.save()
    _, key = ApiKey.objects.create_key("drain")
    return key


def _usage_records() -> int:
    if settings.NEXUS_USAGE_TRANSPORT == "redis":
        drain_usage_stream()
    return UsageRecord.objects.filter(backend="mock-drain").count()


class Streams:
    """STREAMS streaming chats in threads, each collecting its text."""

    def __init__(self, base_url: str, key: str) -> None:
        self.sdk = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60
        )
        self.texts: list[str] = [""] * STREAMS
        self.finished: list[bool] = [False] * STREAMS
        self.errors: list[BaseException] = []
        self.started = threading.Semaphore(0)
        self.threads = [
            threading.Thread(target=self._run, args=(n,), daemon=True)
            for n in range(STREAMS)
        ]

    def _run(self, n: int) -> None:
        try:
            stream = self.sdk.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"stream {n}"}],
                stream=True,
            )
            first = True
            for chunk in stream:
                if first:
                    self.started.release()
                    first = False
                if chunk.choices:
                    self.texts[n] += chunk.choices[0].delta.content or ""
            self.finished[n] = True
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.errors.append(error)
            self.started.release()

    def start_and_wait_for_first_chunks(self) -> None:
        for thread in self.threads:
            thread.start()
        for _ in range(STREAMS):
            assert self.started.acquire(timeout=30), "a stream never started"

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=60)


def _assert_all_complete(streams: Streams) -> None:
    assert streams.errors == []
    assert all(streams.finished)
    for n, text in enumerate(streams.texts):
        assert text.startswith("[mock-drain/llama3:8b]"), text
        assert f"stream {n}" in text


def test_sigterm_to_daphne_finishes_every_stream_and_bills_it(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    mock = mock_backend_factory(
        "--models", MODEL, "--name", "mock-drain", "--chunks", str(CHUNKS),
        "--chunk-delay-ms", "100",
    )  # fmt: skip
    key = _setup(mock)
    server = nexus_server_factory()
    assert httpx.get(f"{server.base_url}/health/ready").status_code == 200
    streams = Streams(server.base_url, key)
    streams.start_and_wait_for_first_chunks()

    server.process.send_signal(signal.SIGTERM)

    # While draining: not ready, still live, and new work is turned away.
    deadline = time.monotonic() + 5
    while (ready := httpx.get(f"{server.base_url}/health/ready")).status_code != 503:
        assert time.monotonic() < deadline, ready.text
        time.sleep(0.02)
    assert ready.json() == {"status": "draining"}
    assert httpx.get(f"{server.base_url}/health/live").status_code == 200
    refused = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "late"}]},
    )
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"

    streams.join()
    _assert_all_complete(streams)
    assert _exit_code(server, timeout=30) == 0
    assert _usage_records() == STREAMS


def _exit_code(server: NexusServer, timeout: float) -> int:
    """The server's exit code; if it is still running, fail with its stacks."""
    try:
        return server.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = subprocess.run(
            [
                Path(sys.executable).with_name("py-spy"),
                "dump",
                "--pid",
                str(server.process.pid),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        pytest.fail(
            f"still running {timeout} s after its streams ended; its stacks:\n"
            f"{stacks.stdout}{stacks.stderr}\nits log:\n" + "".join(server.log[-80:])
        )


def test_sigterm_to_nexus_run_drains_every_serving_process(
    mock_backend_factory: Callable[..., MockBackendProcess], tmp_path: Path
) -> None:
    mock = mock_backend_factory(
        "--models", MODEL, "--name", "mock-drain", "--chunks", str(CHUNKS),
        "--chunk-delay-ms", "100",
    )  # fmt: skip
    key = _setup(mock)
    with httpx.Client() as probe:
        port = _free_port()
        # A state directory of its own: its Celery worker and beat use the
        # broker queue and schedule kept there.
        env = server_env() | {"NEXUS_STATE_DIR": str(tmp_path / "state")}
        launcher = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "nexus_run",
                "--no-demo",
                "--workers",
                "2",
                "--port",
                str(port),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        output: list[str] = []
        reader = threading.Thread(
            target=lambda: output.extend(launcher.stdout or ()), daemon=True
        )
        reader.start()
        try:
            base_url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                assert launcher.poll() is None, "".join(output)
                assert time.monotonic() < deadline, "".join(output)
                try:
                    if probe.get(f"{base_url}/health/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            # Several processes answer on the port (a new connection each time
            # goes to whichever accepts first); /metrics sums all of them.
            for _ in range(8):
                httpx.post(
                    f"{base_url}/v1/chat/completions",
                    headers={"authorization": f"Bearer {key}", "connection": "close"},
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "m"}],
                    },
                    timeout=30,
                ).raise_for_status()
            metrics = probe.get(f"{base_url}/metrics").text
            assert sample(metrics, "nexus_requests_total", status="200") == 8
            streams = Streams(base_url, key)
            streams.start_and_wait_for_first_chunks()

            os.kill(launcher.pid, signal.SIGTERM)

            streams.join()
            assert launcher.wait(timeout=60) == 0, "".join(output)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    _assert_all_complete(streams)
    reader.join(timeout=5)
    text = "".join(output)
    assert "Serving with daphne: 2 processes on one port" in text
    assert _usage_records() == STREAMS + 8


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
