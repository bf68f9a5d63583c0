"""Mock backends of every kind as real processes, for health and discovery tests."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from backends.models import Backend, HealthStatus
from nexus_mock import MockBackendProcess, spawn_mock_backend
from tests import zygote
from tests.factories import BackendFactory


@dataclass
class KindMock:
    """A running mock backend and a client for its control API."""

    kind: str
    process: MockBackendProcess
    http: httpx.Client

    @property
    def base_url(self) -> str:
        return self.process.base_url

    def configure(self, **knobs: Any) -> dict[str, Any]:
        response = self.http.post("/_mock/config", json=knobs)
        assert response.status_code == 200, response.text
        config: dict[str, Any] = response.json()
        return config

    def reset(self) -> None:
        self.http.post("/_mock/reset").raise_for_status()

    def refuse(self) -> None:
        """Refuse connections (as a stopped server would) until listen()."""
        self.configure(refuse=True)

    def listen(self) -> None:
        """Accept connections again and wait until they are taken."""
        self.process.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                self.http.get("/_mock/config").raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(0.02)
        raise AssertionError(f"{self.kind} mock did not listen again")

    def register(self, name: str, **fields: Any) -> Backend:
        """Create the Backend row for this mock (health unknown by default)."""
        fields.setdefault("status", HealthStatus.UNKNOWN)
        backend: Backend = BackendFactory(
            name=name, base_url=self.base_url, kind=self.kind, **fields
        )
        return backend

    def stop(self) -> None:
        self.http.close()
        self.process.stop()


def start_kind_mock(kind: str, *args: str) -> KindMock:
    process = spawn_mock_backend(
        "--kind", kind, "--name", f"mock-{kind}", *args, popen=zygote.Popen
    )
    return KindMock(kind, process, httpx.Client(base_url=process.base_url))


@contextmanager
def running_mocks(*specs: tuple[str, ...]) -> Iterator[list[KindMock]]:
    """Start mocks in parallel, each from (kind, *cli args); stop them after."""
    with ThreadPoolExecutor(len(specs)) as pool:
        mocks = list(pool.map(lambda spec: start_kind_mock(*spec), specs))
    try:
        yield mocks
    finally:
        for mock in mocks:
            mock.stop()


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextmanager
def blackhole() -> Iterator[str]:
    """A loopback URL that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # The kernel completes handshakes into the backlog; nobody ever reads.
    sock.listen(512)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
