"""The launcher's wait for the serving processes, on real sockets."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nexus_site.launcher import (
    Child,
    Supervisor,
    open_listener,
    wait_until_serving,
)


@pytest.fixture
def child() -> Iterator[Child]:
    """A live process standing in for the serving process."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    yield Child("web", process)
    process.kill()
    process.wait()


def _serve_once(listener: object, status: str, seen: list[bytes]) -> threading.Thread:
    def answer() -> None:
        connection, _ = listener.accept()  # type: ignore[attr-defined]
        with connection:
            seen.append(connection.recv(4096))
            connection.sendall(
                f"HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n".encode()
            )

    return threading.Thread(target=answer, daemon=True)


def test_a_listening_socket_nobody_accepts_on_is_not_serving(child: Child) -> None:
    """Connections succeed into the launcher's backlog before Daphne is up."""
    listener = open_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    stopping = threading.Event()
    said: list[str] = []
    timer = threading.Timer(2.5, stopping.set)
    timer.start()
    try:
        served = wait_until_serving(
            "127.0.0.1", port, child, stopping, said.append, patience=0.5
        )
    finally:
        timer.cancel()
        listener.close()
    assert served is False
    assert said == [f"Still waiting for the web server to answer on 127.0.0.1:{port}…"]


def test_any_http_answer_means_serving(child: Child) -> None:
    listener = open_listener("0.0.0.0", 0)
    port = listener.getsockname()[1]
    seen: list[bytes] = []
    server = _serve_once(listener, "503 Service Unavailable", seen)
    server.start()
    try:
        served = wait_until_serving(
            "0.0.0.0",
            port,
            child,
            threading.Event(),
            print,
            host_header="gateway.example.com",
        )
    finally:
        server.join(timeout=5)
        listener.close()
    assert served is True
    assert seen[0].startswith(b"GET /health/live HTTP/1.1\r\n")
    assert b"\r\nHost: gateway.example.com\r\n" in seen[0]


def test_a_serving_process_that_dies_first_is_reported(child: Child) -> None:
    listener = open_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    child.process.kill()
    try:
        served = wait_until_serving("127.0.0.1", port, child, threading.Event(), print)
    finally:
        listener.close()
    assert served is False


class _Lines:
    """The supervisor's output, line by line, waited on."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def write(self, text: str) -> None:
        with self.changed:
            self.lines.extend(text.splitlines())
            self.changed.notify_all()

    def flush(self) -> None:
        pass

    def wait_for(self, count: int, text: str, timeout: float = 30.0) -> list[str]:
        with self.changed:
            found = self.changed.wait_for(
                lambda: sum(text in line for line in self.lines) >= count, timeout
            )
            assert found, f"{count} x {text!r} not in {self.lines}"
            return [line for line in self.lines if text in line]


@pytest.mark.mode_independent
def test_a_child_that_keeps_dying_is_restarted_with_a_growing_delay(
    tmp_path: Path,
) -> None:
    out = _Lines()
    restarts = tmp_path / "restarts.json"
    supervisor = Supervisor(out, grace=5, restarts_file=restarts)
    supervisor.start("worker", [sys.executable, "-c", "raise SystemExit(3)"])
    waiting = threading.Thread(target=supervisor.wait, daemon=True)
    waiting.start()
    try:
        said = out.wait_for(3, "exited with 3; restarting it in")
        out.wait_for(2, "worker restarted (pid")
    finally:
        supervisor.stopping.set()
        waiting.join(timeout=10)
        supervisor.stop()

    delays = [line.rsplit(" in ", 1)[1] for line in said[:3]]
    assert delays == ["1 s.", "2 s.", "4 s."]
    assert json.loads(restarts.read_text())["worker"] >= 2


@pytest.mark.mode_independent
def test_a_child_started_elsewhere_that_dies_is_let_go(tmp_path: Path) -> None:
    out = _Lines()
    supervisor = Supervisor(out, grace=5)
    process = subprocess.Popen(
        [sys.executable, "-c", "raise SystemExit(0)"], stdout=subprocess.PIPE, text=True
    )
    supervisor.adopt("demo-alpha", process)
    waiting = threading.Thread(target=supervisor.wait, daemon=True)
    waiting.start()
    try:
        out.wait_for(1, "demo-alpha (pid")
    finally:
        supervisor.stopping.set()
        waiting.join(timeout=10)
        supervisor.stop()
    assert supervisor.children == []
