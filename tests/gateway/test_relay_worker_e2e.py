"""The real nexus-worker through a real gateway: what its side of the contract owes.

One Nexus server (Daphne) and the worker daemon as its own process, with the
mock backend as the worker's local model server; the official openai SDK is
the client. The seed's contract list is in tests/gateway/test_relay_e2e.py
(registration, revocation, cancel, requeue, heartbeats, drain, two serving
processes, usage); these add what the worker's side owes a user: SIGTERM on
the worker finishing the stream in flight, long client request ids, and an
Ollama box serving OpenAI clients.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from backends.models import Worker
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    wait_until,
)
from tests.gateway.relay_workers import WorkerProcess, start_worker
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)  # the server writes too
WAIT = 20.0


@dataclass
class Relay:
    server: NexusServer
    local: MockBackendProcess
    key: str
    secrets: dict[str, str]
    workers: list[WorkerProcess] = field(default_factory=list)

    def sdk(self, **options: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.server.base_url}/v1",
            api_key=self.key,
            max_retries=0,
            timeout=WAIT,
            **options,  # type: ignore[arg-type]
        )

    def start_worker(self, name: str, *args: str) -> WorkerProcess:
        worker = start_worker(
            self.server, self.local, self.secrets[name], "--name", name, *args
        )
        self.workers.append(worker)
        return worker

    def wait_until_served(self, name: str, model: str) -> None:
        """Wait until the gateway routes ``model`` to worker ``name``."""

        def served() -> bool:
            try:
                reply = self.sdk().chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "ping"}]
                )
            except openai.APIError:
                return False
            return bool(reply.choices)

        try:
            wait_until(served, WAIT, f"{model} served through {name}")
        except AssertionError as failure:
            logs = "".join(self.workers[-1].log) + "".join(self.server.log[-40:])
            raise AssertionError(f"{failure}\n{logs}") from None

    def mock_stats(self) -> dict:
        return httpx.get(f"{self.local.base_url}/_mock/stats", timeout=5).json()

    def mock_config(self, **knobs: object) -> None:
        reply = httpx.post(f"{self.local.base_url}/_mock/config", json=knobs, timeout=5)
        assert reply.status_code == 200, reply.text


@pytest.fixture(scope="module")
def local_backend() -> Iterator[MockBackendProcess]:
    """The workers' local model server (reset before each test)."""
    local = start_mock_backend(
        "--models", "llama3:8b", "--name", "gpu", "--chunks", "5"
    )
    yield local
    local.stop()


@pytest.fixture
def relay(
    local_backend: MockBackendProcess,
    nexus_server_factory: Callable[..., NexusServer],
) -> Iterator[Relay]:
    """A gateway with worker secrets made and a client key; workers stopped after."""
    httpx.post(f"{local_backend.base_url}/_mock/reset", timeout=5)
    secrets = {
        name: Worker.objects.create_worker(name)[1] for name in ("gpu-1", "gpu-ollama")
    }
    _, key = ApiKey.objects.create_key("relay-worker-e2e")
    server = nexus_server_factory(
        NEXUS_RELAY_HEARTBEAT_SECONDS="1", NEXUS_RELAY_SEEN_WRITE_SECONDS="1"
    )
    relay = Relay(server, local_backend, key, secrets)
    yield relay
    for worker in relay.workers:
        worker.stop()
        # Shown by pytest only when the test failed.
        print("worker log:\n" + "".join(worker.log))  # noqa: T201
    print("gateway log:\n" + "".join(server.log[-80:]))  # noqa: T201


def test_sigterm_on_the_worker_finishes_the_stream_in_flight_and_exits_0(
    relay: Relay,
) -> None:
    worker = relay.start_worker("gpu-1")
    relay.wait_until_served("gpu-1", "llama3:8b")
    relay.mock_config(chunks=10, chunk_delay_ms=100)
    stream = relay.sdk().chat.completions.create(
        model="llama3:8b", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].delta.content or ""
    worker.process.send_signal(signal.SIGTERM)
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text == "[gpu/llama3:8b] echo: hi"
    assert worker.process.wait(WAIT) == 0
    assert any("draining (SIGTERM)" in line for line in worker.log)


def test_a_client_request_id_of_the_longest_kind_is_served(
    relay: Relay,
) -> None:
    worker = relay.start_worker("gpu-1")
    relay.wait_until_served("gpu-1", "llama3:8b")
    request_id = "r" * 128  # the most the proxy keeps from X-Request-ID
    reply = relay.sdk(default_headers={"X-Request-ID": request_id}).with_raw_response
    raw = reply.chat.completions.create(
        model="llama3:8b", messages=[{"role": "user", "content": "long id"}]
    )
    assert raw.headers["x-request-id"] == request_id
    completion = raw.parse()
    assert completion.choices[0].message.content == "[gpu/llama3:8b] echo: long id"
    worker.stop()


def test_an_ollama_box_serves_openai_clients(relay: Relay) -> None:
    ollama = start_mock_backend(
        "--models", "qwen2.5:7b", "--kind", "ollama", "--name", "box"
    )
    try:
        worker = start_worker(
            relay.server, ollama, relay.secrets["gpu-ollama"], "--name", "gpu-ollama"
        )
        relay.workers.append(worker)
        relay.wait_until_served("gpu-ollama", "qwen2.5:7b")
        stream = relay.sdk().chat.completions.create(
            model="qwen2.5:7b",
            messages=[{"role": "user", "content": "hello box"}],
            stream=True,
        )
        text = "".join(
            chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
        )
        assert text == "[box/qwen2.5:7b] echo: hello box"
        assert any("speaks ollama" in line for line in worker.log)
        worker.stop()
    finally:
        ollama.stop()
