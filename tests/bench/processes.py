"""The processes under test: the mock backend and one Nexus serving process.

Each runs as a child process, optionally pinned to CPUs with ``taskset`` (set
before exec, so every thread it starts inherits the pinning). Resource figures
come from /proc: CPU time from ``stat``, peak resident memory from ``status``'s
VmHWM.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from nexus_site.mock_backend import MockStartError, spawn_mock_backend
from tests.bench.clients import BenchError

START_TIMEOUT = 60.0
SERVERS = ("daphne", "uvicorn")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Pinning:
    """Which CPUs each party may use (empty sets: not pinned)."""

    server: frozenset[int]
    mock: frozenset[int]
    # The load generator shares the mock's CPU while Nexus is measured, and
    # takes the otherwise idle server CPU when the mock is measured directly.
    load_via_nexus: frozenset[int]
    load_direct: frozenset[int]

    @property
    def enabled(self) -> bool:
        return bool(self.server)

    def describe(self) -> str:
        if not self.enabled:
            return "not pinned"
        return (
            f"serving process on CPU {_cpus(self.server)}; mock backend and load "
            f"generators on CPU {_cpus(self.mock)} (for direct-to-mock runs the load "
            f"generators use CPU {_cpus(self.load_direct)}, idle then)"
        )


def _cpus(cpus: Collection[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def plan_pinning(wanted: bool) -> Pinning:
    """Give the serving process a CPU of its own when there are two or more."""
    available = sorted(os.sched_getaffinity(0))
    if not wanted or len(available) < 2 or shutil.which("taskset") is None:
        empty: frozenset[int] = frozenset()
        return Pinning(empty, empty, empty, empty)
    server = frozenset({available[-1]})
    rest = frozenset(available[:-1])
    return Pinning(server=server, mock=rest, load_via_nexus=rest, load_direct=server)


def pin_prefix(cpus: Collection[int]) -> list[str]:
    """The ``taskset`` words that run a command on ``cpus`` (none when unpinned)."""
    return ["taskset", "-c", _cpus(cpus)] if cpus else []


@dataclass
class Child:
    """A started child process and the log file its output goes to."""

    label: str
    process: subprocess.Popen[str]
    log_path: Path
    url: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        """User plus system CPU time used so far (all threads)."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def memory_kib(self) -> dict[str, int]:
        """VmRSS (now) and VmHWM (peak) in KiB."""
        values = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0])
        return values

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise BenchError(
                f"{self.label} exited with status {self.process.returncode}:\n"
                + self.log_tail()
            )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _spawn(
    label: str, argv: Sequence[str], env: dict[str, str], cwd: Path, logs: Path
) -> Child:
    log_path = logs / f"{label}.log"
    # The child keeps its own copy of the file; ours is not needed after the fork.
    with log_path.open("w") as log:
        process = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    return Child(label, process, log_path)


def start_mock(
    env: dict[str, str],
    cwd: Path,
    logs: Path,
    cpus: Collection[int],
    *,
    name: str,
    model: str,
    chunks: int,
) -> Child:
    """Start the mock backend on a free port and wait for its address."""
    log_path = logs / "mock.log"
    try:
        mock = spawn_mock_backend(
            "--models",
            model,
            "--name",
            name,
            "--chunks",
            str(chunks),
            timeout=START_TIMEOUT,
            output=log_path,
            env=env,
            cwd=cwd,
            command_prefix=pin_prefix(cpus),
        )
    except MockStartError as error:
        raise BenchError(str(error)) from None
    return Child("mock", mock.process, log_path, url=mock.base_url)


def server_argv(kind: str, port: int) -> list[str]:
    """How the serving process is started: as ``nexus_run`` does, one process."""
    app = "nexus_site.asgi:application"
    if kind == "daphne":
        host = ["-b", "127.0.0.1", "-p", str(port)]
        return [sys.executable, "-m", "daphne", *host, "--proxy-headers", app]
    if kind == "uvicorn":
        host = ["--host", "127.0.0.1", "--port", str(port)]
        return [sys.executable, "-m", "uvicorn", *host, "--proxy-headers", app]
    raise ValueError(f"unknown server {kind!r}")


def start_server(
    kind: str,
    env: dict[str, str],
    cwd: Path,
    logs: Path,
    cpus: Collection[int],
    probe_headers: dict[str, str],
) -> Child:
    """Start one Nexus serving process and wait until /v1/models answers 200."""
    port = _free_port()
    child = _spawn(kind, [*pin_prefix(cpus), *server_argv(kind, port)], env, cwd, logs)
    child.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    last = ""
    with httpx.Client(timeout=2, trust_env=False) as client:
        while time.monotonic() < deadline:
            child.check_alive()
            try:
                response = client.get(f"{child.url}/v1/models", headers=probe_headers)
            except httpx.HTTPError as error:
                last = str(error)
            else:
                if response.status_code == 200:
                    return child
                last = f"HTTP {response.status_code}: {response.text[:300]}"
            time.sleep(0.1)
    child.stop()
    raise BenchError(f"{kind} did not become ready ({last}):\n" + child.log_tail())


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def version_of(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"
