"""Start a mock backend as a child process and wait until it listens.

Demo mode, the tests and the benchmark all start mocks this one way: on a free
port, waiting (with a timeout) for the start-up line that names the address.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

READY_LINE = re.compile(r"listening on (http://\S+)")
START_TIMEOUT = 20.0
STOP_TIMEOUT = 10.0


class MockStartError(RuntimeError):
    """The mock backend exited or stayed silent instead of listening."""


@dataclass
class MockBackendProcess:
    """A running mock backend child process and the address it listens on."""

    process: subprocess.Popen[str]
    base_url: str

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def stop(self) -> None:
        """Terminate the mock (it exits at once on SIGTERM); kill it if it hangs."""
        _stop_process(self.process)


def spawn_mock_backend(
    *args: str,
    host: str = "127.0.0.1",
    timeout: float = START_TIMEOUT,
    output: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    command_prefix: Sequence[str] = (),
    new_session: bool = False,
    module: str = "nexus_mock",
    popen: Callable[..., subprocess.Popen[str]] = subprocess.Popen,
) -> MockBackendProcess:
    """Start ``python -m nexus_mock`` with ``args`` on a free port.

    Without ``output`` the child's stdout is a pipe that is left open after the
    start-up line: the caller owns it from then on (a chatty child would block on
    a full pipe). With ``output`` the child writes to that file instead.
    ``command_prefix`` goes before the interpreter (e.g. ``taskset -c 0``), and
    ``new_session`` keeps the terminal's Ctrl-C away from the child.
    ``module`` runs another server that prints the same kind of start-up line
    (``tests.hostile_backend``). ``popen`` starts the child (the
    tests pass one that forks it from a process with the imports done).

    Raises MockStartError, with the child's output, if it exits or does not
    print its address within ``timeout`` seconds.
    """
    argv = [
        *command_prefix,
        sys.executable,
        "-m",
        module,
        "--host",
        host,
        "--port",
        "0",
        *args,
    ]
    if output is None:
        process = popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=new_session,
        )
        base_url, seen = _read_ready_line(process, timeout)
    else:
        with output.open("w") as log:
            process = popen(
                argv,
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=new_session,
            )
        base_url, seen = _poll_ready_line(process, output, timeout)
    if base_url is None:
        _stop_process(process)
        raise MockStartError(
            f"the mock backend ({' '.join(args)}) did not start within {timeout:g} s "
            f"(exit status {process.returncode}):\n{seen}"
        )
    return MockBackendProcess(process=process, base_url=base_url)


def _read_ready_line(
    process: subprocess.Popen[str], timeout: float
) -> tuple[str | None, str]:
    """Read the pipe up to the start-up line; return its URL (None) and the text."""
    stdout = process.stdout
    assert stdout is not None
    seen: list[str] = []
    found: list[str] = []

    def read() -> None:
        for line in stdout:
            seen.append(line)
            match = READY_LINE.search(line)
            if match:
                found.append(match.group(1))
                # Stop here: the rest of the pipe belongs to the caller.
                return

    # A thread, because a blocking readline cannot time out on its own.
    reader = threading.Thread(target=read, name="mock-ready-line", daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        _stop_process(process)
        reader.join(STOP_TIMEOUT)
    return (found[0] if found else None), "".join(seen)


def _poll_ready_line(
    process: subprocess.Popen[str], output: Path, timeout: float
) -> tuple[str | None, str]:
    """Watch ``output`` for the start-up line; return its URL (None) and the text."""
    deadline = time.monotonic() + timeout
    while True:
        exited = process.poll() is not None
        text = output.read_text(errors="replace")
        match = READY_LINE.search(text)
        if match:
            return match.group(1), text
        if exited or time.monotonic() >= deadline:
            return None, text
        time.sleep(0.05)


def _stop_process(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
