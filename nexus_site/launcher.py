"""Run every Nexus process from one command and stop them all on Ctrl-C.

Children get their own sessions so that the terminal's Ctrl-C reaches only the
launcher, which then shuts them down in order (SIGTERM, then SIGKILL after a
grace period) instead of every process racing to handle SIGINT at once.

A child the launcher started that dies (a crash, the OOM killer, ``kill -9``)
is started again, with the same command, after a back-off (1 s, doubling up to
30 s while it keeps dying within a minute of its start): one dead serving
process is not a dead gateway. Each restart is said in the output and counted
in a small JSON file (``restarts_file``) that the serving processes' /metrics
reads (``nexus_process_restarts_total``).

A launcher that is itself killed (``kill -9``, the OOM killer) takes its
children with it: each is started with the kernel's parent-death signal
(SIGTERM, so serving processes still drain and Redis exits cleanly) instead
of living on, holding the port and the private Redis, until the next start
said "Another nexus_run serves from ...".
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# How long children get between SIGTERM and SIGKILL, beyond the serving
# processes' own drain period.
STOP_GRACE_SECONDS = 10.0
# Restart back-off: the first restart after this long, doubling up to the
# maximum while a child keeps dying within STABLE_SECONDS of its start.
RESTART_DELAY_MIN = 1.0
RESTART_DELAY_MAX = 30.0
STABLE_SECONDS = 60.0


class Writer(Protocol):
    def write(self, text: str, /) -> Any: ...
    def flush(self) -> Any: ...


@dataclass
class Launch:
    """How to start a child again: its command, inherited fds and environment."""

    argv: list[str]
    pass_fds: tuple[int, ...] = ()
    env: dict[str, str] | None = None
    # What the child gets if the launcher dies without stopping it (die_with).
    death_signal: int = signal.SIGTERM


@dataclass
class Child:
    label: str
    process: subprocess.Popen[str]
    pump: threading.Thread | None = field(default=None, repr=False)
    # None for a process started elsewhere (adopted): not restarted.
    launch: Launch | None = field(default=None, repr=False)
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    # Restarts in a row that died within STABLE_SECONDS (sets the back-off).
    quick_deaths: int = 0
    restart_at: float | None = None
    # Stopped after every other child has exited (the private Redis, which
    # the others write to as they drain).
    stop_last: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid


class StopFlag:
    """Set by a signal handler, read by the launcher's loops: no lock.

    (``threading.Event.set()`` in a handler deadlocks when the signal lands
    while the main thread holds the event's own lock, inside ``wait()``: a
    Ctrl-C that then never stops anything.)
    """

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Sleep until set or `timeout` seconds pass; return whether set."""
        deadline = time.monotonic() + timeout
        while not self._set:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(remaining, 0.05))
        return True


class Supervisor:
    """Start child processes, prefix their output, and stop them together."""

    def __init__(
        self,
        out: Writer = sys.stdout,
        grace: float = STOP_GRACE_SECONDS,
        restarts_file: Path | None = None,
    ) -> None:
        self.grace = grace
        self.restarts_file = restarts_file
        self.children: list[Child] = []
        self._out = out
        self._out_lock = threading.Lock()
        self._stop = StopFlag()

    def say(self, text: str) -> None:
        with self._out_lock:
            self._out.write(text + "\n")
            self._out.flush()

    def start(
        self,
        label: str,
        argv: Sequence[str],
        *,
        pass_fds: Sequence[int] = (),
        env: dict[str, str] | None = None,
        stop_last: bool = False,
        death_signal: int = signal.SIGTERM,
    ) -> Child:
        """Start a child, restarted with the same command whenever it dies."""
        launch = Launch(list(argv), tuple(pass_fds), env, death_signal)
        child = self.adopt(label, _spawn(launch))
        child.launch = launch
        child.stop_last = stop_last
        return child

    def adopt(self, label: str, process: subprocess.Popen[str]) -> Child:
        """Supervise a process started elsewhere (its stdout must be a pipe)."""
        child = Child(label, process)
        self._pump_output(child)
        self.children.append(child)
        return child

    def forget(self, child: Child) -> None:
        """Kill a child and stop supervising it (one that failed to start)."""
        _signal_group(child.process, signal.SIGKILL)
        child.process.wait()
        self.children.remove(child)

    def _pump_output(self, child: Child) -> None:
        process = child.process
        child.pump = threading.Thread(
            target=self._pump,
            args=(child.label, process),
            name=f"pump-{child.label}",
            daemon=True,
        )
        child.pump.start()

    def _pump(self, label: str, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.say(f"[{label}] {line.rstrip()}")

    def install_signal_handlers(self) -> None:
        def request_stop(signum: int, frame: object) -> None:
            self._stop.set()

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

    @property
    def stopping(self) -> StopFlag:
        """Set once SIGINT or SIGTERM asked the launcher to stop."""
        return self._stop

    def wait(self) -> int:
        """Block until asked to stop, restarting children that die; return 0."""
        while not self._stop.wait(0.2):
            now = time.monotonic()
            for child in list(self.children):
                if child.restart_at is not None:
                    if now >= child.restart_at:
                        self._restart(child)
                    continue
                code = child.process.poll()
                if code is not None:
                    self._died(child, code, now)
        return 0

    def _died(self, child: Child, code: int, now: float) -> None:
        if child.launch is None:
            self.say(f"{child.label} (pid {child.pid}) exited with {code}.")
            self.children.remove(child)
            return
        if now - child.started_at >= STABLE_SECONDS:
            child.quick_deaths = 0
        delay = min(RESTART_DELAY_MIN * 2**child.quick_deaths, RESTART_DELAY_MAX)
        child.quick_deaths += 1
        child.restart_at = now + delay
        self.say(
            f"{child.label} (pid {child.pid}) exited with {code}; restarting it "
            f"in {delay:g} s."
        )

    def _restart(self, child: Child) -> None:
        assert child.launch is not None
        # Grandchildren (Celery pool processes) share the dead child's group.
        _signal_group(child.process, signal.SIGKILL)
        try:
            child.process = _spawn(child.launch)
        except OSError as error:
            child.restart_at = time.monotonic() + RESTART_DELAY_MAX
            self.say(f"Could not restart {child.label} ({error}); trying again.")
            return
        child.started_at = time.monotonic()
        child.restart_at = None
        child.restarts += 1
        self._pump_output(child)
        self._write_restarts()
        self.say(f"{child.label} restarted (pid {child.pid}).")

    def _write_restarts(self) -> None:
        """Publish the restart counts for /metrics (replaced whole, atomically)."""
        path = self.restarts_file
        if path is None:
            return
        counts = {child.label: child.restarts for child in self.children}
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps(counts))
            temporary.replace(path)

    def stop(self, before_last: Callable[[], None] | None = None) -> None:
        """Stop children, newest first, politely then by force.

        Children started with ``stop_last`` are stopped once the others have
        exited, after ``before_last`` has run.
        """
        self._stop_children([c for c in self.children if not c.stop_last])
        last = [child for child in self.children if child.stop_last]
        if last and before_last is not None:
            before_last()
        self._stop_children(last)
        for child in self.children:
            if child.pump is not None:
                child.pump.join(timeout=2)

    def _stop_children(self, children: list[Child]) -> None:
        for child in reversed(children):
            _signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for child in reversed(children):
            remaining = max(0.0, deadline - time.monotonic())
            try:
                child.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                self.say(f"{child.label} did not stop in time; killing it.")
                _signal_group(child.process, signal.SIGKILL)
                child.process.wait()
            # Grandchildren (Celery pool processes) share the child's group.
            _signal_group(child.process, signal.SIGKILL)


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    prctl: Callable[..., int] = libc.prctl
    return prctl


# Looked up once here: between fork and exec nothing may import or allocate
# much (other threads' locks are copied held).
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def die_with(parent: int, signum: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` that has the child sent `signum` (SIGTERM: stop
    cleanly) when `parent` (this process) dies.

    The kernel sends it when the thread that forked the child exits, so every
    child is started from the launcher's main thread (``start``, ``adopt``'s
    callers, ``wait``'s restarts). A parent already gone by then is seen
    after the prctl, and the child exits at once. Where prctl is missing (not
    Linux) children outlive a killed launcher, as before.
    """

    def preexec() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)

    return preexec


def _spawn(launch: Launch) -> subprocess.Popen[str]:
    return subprocess.Popen(
        launch.argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
        # Safe with threads: one ctypes call looked up beforehand (die_with).
        preexec_fn=die_with(os.getpid(), launch.death_signal),  # noqa: PLW1509
        pass_fds=launch.pass_fds,
        env=launch.env,
    )


def _signal_group(process: subprocess.Popen[str], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def is_port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def open_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """Bind the gateway's port once, for every serving process to accept on.

    Raises OSError if the address is in use.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def wait_until_serving(
    host: str,
    port: int,
    child: Child,
    stopping: StopFlag | threading.Event,
    say: Callable[[str], None],
    host_header: str = "localhost",
    patience: float = 30.0,
) -> bool:
    """Wait until the serving processes answer HTTP on host:port.

    The launcher opened the listening socket itself, so a connection succeeds
    (into the backlog) long before a serving process has imported Django and
    accepts it: only an answer, of any status, says that requests are served.
    `host_header` should be one the site allows, so the probe logs no
    disallowed host. Returns False if the child exits or a stop is requested
    first; says once that it is still waiting after `patience` seconds (a slow
    or busy machine).
    """
    target = _connectable(host)
    started = time.monotonic()
    told = False
    while not stopping.is_set():
        if child.process.poll() is not None:
            return False
        if not told and time.monotonic() - started > patience:
            say(f"Still waiting for the web server to answer on {host}:{port}…")
            told = True
        connection = http.client.HTTPConnection(target, port, timeout=1.0)
        try:
            # /health/live: answered by the gateway itself, with no database
            # query and nothing logged, whatever the backends' health.
            connection.request("GET", "/health/live", headers={"Host": host_header})
            connection.getresponse().read()
            return True
        except (OSError, http.client.HTTPException):
            time.sleep(0.1)
        finally:
            connection.close()
    return False


def _connectable(host: str) -> str:
    """The address to reach a server listening on host from this machine."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
