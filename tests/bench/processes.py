"""The processes under test: the mock backend and the serving targets.

A serving target is Nexus under one ASGI server, in one process or in several
sharing one port (started as ``nexus_run`` starts them, with
``nexus_site.servers.serving.server_commands`` and a listening socket opened once by
``nexus_site.launcher.open_listener``), the ``bare-daphne`` reference app, or a
peer gateway (LiteLLM). Single-process targets may be pinned to CPUs with
``taskset`` (set before exec, so every thread and child inherits it).

Resource figures come from /proc and cover a target's whole process tree
(granian, for one, runs its workers as child processes): CPU time from
``stat``, resident memory from ``status`` (VmRSS now, VmHWM peak).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from nexus_mock import MockStartError, spawn_mock_backend
from nexus_site.launcher import open_listener
from nexus_site.servers.serving import SERVERS as NEXUS_SERVERS
from nexus_site.servers.serving import server_commands
from tests.bench.clients import BenchError

START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
HOST = "127.0.0.1"
BARE_DAPHNE = "bare-daphne"
BARE_APP = "tests.bench.bare_app:application"
LITELLM = "litellm"
# "daphne-xN": N processes, N from --workers (default: the number of CPUs).
MULTI_SUFFIX = "-xN"
TARGET_CHOICES = (
    BARE_DAPHNE,
    *NEXUS_SERVERS,
    *(f"{server}{MULTI_SUFFIX}" for server in NEXUS_SERVERS),
)
DEFAULT_TARGETS = (BARE_DAPHNE, "daphne", "uvicorn", "granian", "daphne-xN")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_MULTI = re.compile(r"^(?P<server>[a-z]+)-x(?P<workers>N|[0-9]+)$")


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """One serving target: which server, how many processes, and what it is for."""

    label: str  # as reported: "daphne", "daphne-x2", "bare-daphne", "litellm"
    server: str  # daphne, uvicorn, granian or litellm
    workers: int = 1
    role: str = "nexus"  # "nexus", "reference" (bare-daphne) or "peer" (litellm)

    @property
    def is_multi_process(self) -> bool:
        return self.workers > 1


def parse_targets(names: Sequence[str], workers: int) -> tuple[TargetSpec, ...]:
    """Turn ``--servers`` names into targets; ``-xN`` means ``workers`` processes.

    Raises ValueError naming the first unknown name.
    """
    specs = []
    for name in names:
        if name == BARE_DAPHNE:
            specs.append(TargetSpec(BARE_DAPHNE, "daphne", role="reference"))
        elif name in NEXUS_SERVERS:
            specs.append(TargetSpec(name, name))
        elif (match := _MULTI.match(name)) and match["server"] in NEXUS_SERVERS:
            count = workers if match["workers"] == "N" else int(match["workers"])
            if count < 2:
                raise ValueError(f"{name} needs at least 2 processes, not {count}")
            server = match["server"]
            specs.append(TargetSpec(f"{server}-x{count}", server, workers=count))
        else:
            raise ValueError(name)
    return tuple(specs)


@dataclass(frozen=True, slots=True)
class Pinning:
    """Which CPUs each party may use (empty sets: not pinned)."""

    server: frozenset[int]
    mock: frozenset[int]
    # The load generator shares the mock's CPU while a server is measured, and
    # takes the otherwise idle server CPU when the mock is measured directly.
    load_via_server: frozenset[int]
    load_direct: frozenset[int]

    @property
    def enabled(self) -> bool:
        return bool(self.server)

    def describe(self) -> str:
        if not self.enabled:
            return "not pinned"
        return (
            f"single-process targets on CPU {_cpus(self.server)}; mock backend and "
            f"load generators on CPU {_cpus(self.mock)} (for direct-to-mock runs the "
            f"load generators use CPU {_cpus(self.load_direct)}, idle then); "
            "multi-process targets, and the mock and load generators while they "
            "are measured, not pinned (they need every CPU)"
        )


def _cpus(cpus: Collection[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def plan_pinning(wanted: bool) -> Pinning:
    """Give a single serving process a CPU of its own when there are two or more."""
    available = sorted(os.sched_getaffinity(0))
    if not wanted or len(available) < 2 or shutil.which("taskset") is None:
        empty: frozenset[int] = frozenset()
        return Pinning(empty, empty, empty, empty)
    server = frozenset({available[-1]})
    rest = frozenset(available[:-1])
    return Pinning(server=server, mock=rest, load_via_server=rest, load_direct=server)


def pin_prefix(cpus: Collection[int]) -> list[str]:
    """The ``taskset`` words that run a command on ``cpus`` (none when unpinned)."""
    return ["taskset", "-c", _cpus(cpus)] if cpus else []


@dataclass
class ProcessGroup:
    """Started child processes (one per root) and everything they start in turn."""

    label: str
    roots: list[subprocess.Popen[str]]
    log_paths: list[Path]
    url: str = ""
    # Files to remove when the group stops (e.g. its metrics directory).
    scratch: list[Path] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.roots[0].pid

    def pids(self) -> list[int]:
        """The roots and their living descendants, roots first."""
        return _tree([root.pid for root in self.roots])

    def cpu_seconds_by_process(self) -> dict[int, float]:
        """User plus system CPU time used so far, per process (all its threads)."""
        found = {}
        for pid in self.pids():
            with contextlib.suppress(OSError):
                found[pid] = _cpu_seconds(pid)
        return found

    def cpu_seconds(self) -> float:
        """CPU time used so far by the whole tree."""
        return sum(self.cpu_seconds_by_process().values())

    def memory_kib(self) -> dict[int, dict[str, int]]:
        """VmRSS (now) and VmHWM (peak) in KiB, per process of the tree."""
        found = {}
        for pid in self.pids():
            with contextlib.suppress(OSError):
                found[pid] = _memory_kib(pid)
        return found

    def set_affinity(self, cpus: Collection[int]) -> None:
        """Move every thread of every process of the tree onto ``cpus``."""
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(int(task), cpus)

    def log_tail(self, lines: int = 40) -> str:
        tails = []
        for path in self.log_paths:
            text = path.read_text(errors="replace") if path.exists() else ""
            tails.append(f"--- {path.name}\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(tails)

    def check_alive(self) -> None:
        for root in self.roots:
            if root.poll() is not None:
                raise BenchError(
                    f"{self.label} (pid {root.pid}) exited with status "
                    f"{root.returncode}:\n" + self.log_tail()
                )

    def stop(self) -> None:
        """SIGTERM every process group, then SIGKILL what is left after a while."""
        for root in self.roots:
            _signal_group(root, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for root in self.roots:
            try:
                root.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(root, signal.SIGKILL)
                root.wait()
            # Children the root left behind share its process group.
            _signal_group(root, signal.SIGKILL)
        for path in self.scratch:
            shutil.rmtree(path, ignore_errors=True)


def _signal_group(process: subprocess.Popen[str], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def _stat_fields(pid: int) -> list[str]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name may hold spaces and parentheses: split after the last ")".
    return stat[stat.rindex(")") + 2 :].split()


def _cpu_seconds(pid: int) -> float:
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _memory_kib(pid: int) -> dict[str, int]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            values[name] = int(rest.split()[0])
    return values


def _tree(roots: Sequence[int]) -> list[int]:
    """``roots`` and every living descendant, found through /proc's parent ids."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            parent = int(_stat_fields(int(entry.name))[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    queue = [pid for pid in roots if Path(f"/proc/{pid}").exists()]
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue.extend(sorted(children.get(pid, ())))
    return found


def _is_running(pid: int) -> bool:
    try:
        return _stat_fields(pid)[0] == "R"
    except (OSError, IndexError):
        return False


def start_mock(
    env: dict[str, str],
    cwd: Path,
    logs: Path,
    cpus: Collection[int],
    *,
    name: str,
    model: str,
    chunks: int,
    kind: str = "openai",
) -> ProcessGroup:
    """Start the mock backend on a free port and wait for its address."""
    log_path = logs / f"mock-{kind}.log"
    try:
        mock = spawn_mock_backend(
            "--models",
            model,
            "--name",
            name,
            "--chunks",
            str(chunks),
            "--kind",
            kind,
            timeout=START_TIMEOUT,
            output=log_path,
            env=env,
            cwd=cwd,
            command_prefix=pin_prefix(cpus),
            new_session=True,
        )
    except MockStartError as error:
        raise BenchError(str(error)) from None
    return ProcessGroup("mock", [mock.process], [log_path], url=mock.base_url)


def target_commands(
    spec: TargetSpec, listener: socket.socket, port: int, litellm: list[str]
) -> list[list[str]]:
    """The command lines of a target's root processes.

    Nexus runs exactly as ``nexus_run`` runs it (default options); the bare app
    as Daphne serves any ASGI app; LiteLLM's proxy as ``litellm`` given.
    """
    if spec.role == "reference":
        return [
            [sys.executable, "-m", "daphne", "--fd", str(listener.fileno()), BARE_APP]
        ]
    if spec.role == "peer":
        return [[*litellm, "--host", HOST, "--port", str(port), "--num_workers", "1"]]
    return server_commands(
        spec.server, fd=listener.fileno(), host=HOST, port=port, workers=spec.workers
    )


def start_daphne(env: dict[str, str], logs: Path) -> ProcessGroup:
    """One Daphne serving process in the working directory, on no pinned
    CPUs, ready when /health/ready answers: the scenario benchmarks' gateway."""
    return start_target(
        TargetSpec("daphne", "daphne"), env, Path.cwd(), logs, (), ("/health/ready", {})
    )


def start_target(
    spec: TargetSpec,
    env: dict[str, str],
    cwd: Path,
    logs: Path,
    cpus: Collection[int],
    ready_check: tuple[str, dict[str, str]],
    litellm: Sequence[str] = (),
) -> ProcessGroup:
    """Start a target's processes and wait until all of them are ready.

    Ready: ``ready_check`` (a path and headers) answers 200 and then every
    process of the tree has gone quiet (start-up is CPU-bound; an idle server
    sleeps), so each of several processes sharing a port has finished starting.
    """
    child_env = dict(env)
    child_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    scratch: list[Path] = []
    listener = open_listener(HOST, 0)
    port = int(listener.getsockname()[1])
    try:
        # As nexus_run: several processes answer /metrics, so each writes its
        # values to a shared directory and the one scraped sums them.
        if spec.role == "nexus" and (spec.is_multi_process or spec.server == "granian"):
            metrics = logs / f"metrics-{spec.label}"
            shutil.rmtree(metrics, ignore_errors=True)
            metrics.mkdir(parents=True)
            child_env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)
            scratch.append(metrics)
        commands = target_commands(spec, listener, port, list(litellm))
        # granian and LiteLLM bind the port themselves.
        binds_itself = spec.role == "peer" or (
            spec.role == "nexus" and spec.server == "granian"
        )
        if binds_itself:
            listener.close()
        fds = () if binds_itself else (listener.fileno(),)
        roots, log_paths = [], []
        for number, command in enumerate(commands, start=1):
            suffix = f"-{number}" if len(commands) > 1 else ""
            log_path = logs / f"{spec.label}{suffix}.log"
            log_paths.append(log_path)
            with log_path.open("w") as log:
                roots.append(
                    subprocess.Popen(
                        [*pin_prefix(cpus), *command],
                        cwd=cwd,
                        env=child_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        text=True,
                        pass_fds=fds,
                        start_new_session=True,
                    )
                )
    finally:
        listener.close()  # the children hold their own copies
    group = ProcessGroup(spec.label, roots, log_paths, f"http://{HOST}:{port}", scratch)
    try:
        _wait_until_ready(group, spec, ready_check)
    except BaseException:
        group.stop()
        raise
    return group


def _wait_until_ready(
    group: ProcessGroup, spec: TargetSpec, ready_check: tuple[str, dict[str, str]]
) -> None:
    path, headers = ready_check
    deadline = time.monotonic() + START_TIMEOUT
    last = ""
    with httpx.Client(timeout=2, trust_env=False) as client:
        while True:
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{spec.label} did not become ready ({last}):\n" + group.log_tail()
                )
            group.check_alive()
            try:
                response = client.get(f"{group.url}{path}", headers=headers)
            except httpx.HTTPError as error:
                last = str(error) or type(error).__name__
            else:
                if response.status_code == 200:
                    break
                last = f"HTTP {response.status_code}: {response.text[:300]}"
            time.sleep(0.1)
    _wait_until_quiet(group, deadline)


def _wait_until_quiet(group: ProcessGroup, deadline: float) -> None:
    """Wait for two quiet 0.25 s windows in a row: under 10 % of a CPU in all,
    and no process runnable (a process starved of CPU is runnable, not quiet)."""
    quiet = 0
    before = group.cpu_seconds()
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.25)
        group.check_alive()
        now = group.cpu_seconds()
        busy = now - before > 0.025 or any(_is_running(p) for p in group.pids())
        quiet = 0 if busy else quiet + 1
        before = now


def version_of(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"
