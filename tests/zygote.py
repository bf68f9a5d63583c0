"""Start the tests' Python servers by forking a process that has imported their
libraries already, instead of a fresh interpreter each time.

A Nexus server costs about 1.4 s of CPU to start, a mock backend 0.2 s, and the
suite starts a few hundred of them on a 2-core machine: most of that is
importing Django, DRF, Twisted, aiohttp, httpx, Celery and psycopg. Python's
forkserver (multiprocessing) imports those once per test worker (see
``tests.zygote_preload``: libraries only, never Django's settings, which each
server reads from its own environment) and forks a child per server.

``Popen`` takes the arguments of ``subprocess.Popen`` for
``[sys.executable, "-m", module, *args]``, ``[sys.executable, "-c", code]`` or
``[sys.executable, script, *args]``
and gives back an object with the ``Popen`` methods the tests use (``pid``,
``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``,
``stdout``). The child ends the way the interpreter would (non-daemon threads
joined, ``atexit`` handlers run), so a server's exit behaviour is unchanged.
Anything else (a command prefix such as ``taskset``, a non-Python program)
goes to ``subprocess.Popen``.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import IO, Any

PRELOAD = "tests.zygote_preload"
_context: Any = None
# Called with each ForkedProcess once it has started (tests/cpu_report.py
# watches their CPU, which no os.times() of the test worker counts).
ON_START: list[Callable[[ForkedProcess], None]] = []


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([PRELOAD])
    return _context


def Popen(
    args: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | None = None,
    text: bool = False,
    bufsize: int = -1,
    start_new_session: bool = False,
) -> Any:
    """A child like ``subprocess.Popen(args, ...)``, forked when it can be."""
    forkable = (
        len(args) >= 2
        and args[0] == sys.executable
        and text
        and stderr == subprocess.STDOUT
        and (stdout == subprocess.PIPE or hasattr(stdout, "fileno"))
    )
    if not forkable:
        return subprocess.Popen(
            list(args),
            cwd=cwd,
            env=env,
            stdout=stdout,
            stderr=stderr,
            text=text,
            bufsize=bufsize,
            start_new_session=start_new_session,
        )
    return ForkedProcess(
        list(args[1:]), cwd=cwd, env=env, output=stdout, new_session=start_new_session
    )


def run(
    args: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    timeout: float | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True, ...)`` for
    ``[sys.executable, ...]``, forked; raises ``subprocess.TimeoutExpired`` (and
    ``CalledProcessError`` with ``check``) as it does."""
    assert args[0] == sys.executable, args
    process = ForkedProcess(
        list(args[1:]),
        cwd=cwd,
        env=env,
        output=subprocess.PIPE,
        new_session=False,
        separate_stderr=True,
        with_stdin=input is not None,
    )
    read: dict[str, str] = {}
    streams = {"stdout": process.stdout, "stderr": process.stderr}
    readers = [
        threading.Thread(target=lambda n=name, s=stream: read.update({n: s.read()}))
        for name, stream in streams.items()
    ]
    for reader in readers:
        reader.start()
    if process.stdin is not None:
        with process.stdin:
            process.stdin.write(input or "")
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    finally:
        for reader in readers:
            reader.join()
    result = subprocess.CompletedProcess(
        list(args), code, read.get("stdout", ""), read.get("stderr", "")
    )
    if check:
        result.check_returncode()
    return result


def _reader(output: Any) -> tuple[IO[str] | None, int]:
    """The parent's end of a child's output (PIPE) and the child's fd."""
    if output != subprocess.PIPE:
        return None, os.dup(output.fileno())
    read_fd, write_fd = os.pipe()
    return open(read_fd, encoding="utf-8", errors="replace", buffering=1), write_fd


class ForkedProcess:
    """A server forked from the forkserver, seen through Popen's methods."""

    def __init__(
        self,
        argv: list[str],
        *,
        cwd: str | os.PathLike[str] | None,
        env: Mapping[str, str] | None,
        output: Any,
        new_session: bool,
        separate_stderr: bool = False,
        with_stdin: bool = False,
    ) -> None:
        self.args = [sys.executable, *argv]
        self.stdout, write_fd = _reader(output)
        # The child's stdout, stderr (None: its stdout) and stdin (None: none).
        pipes: list[Connection | None] = [Connection(write_fd, readable=False)]
        self.stderr: IO[str] | None = None
        if separate_stderr:
            self.stderr, error_fd = _reader(subprocess.PIPE)
        pipes.append(Connection(error_fd, readable=False) if separate_stderr else None)
        self.stdin: IO[str] | None = None
        if with_stdin:
            read_fd, input_fd = os.pipe()
            self.stdin = open(input_fd, "w", encoding="utf-8")  # noqa: SIM115
        pipes.append(Connection(read_fd, writable=False) if with_stdin else None)
        self._process = _forkserver().Process(
            target=_run,
            args=(
                argv,
                os.getcwd() if cwd is None else os.fspath(cwd),
                dict(os.environ if env is None else env),
                pipes,
                new_session,
            ),
            name=" ".join(argv[:2]),
            daemon=True,  # terminated if a test worker exits without stopping it
        )
        # The child must not import the test process's main module (the
        # forkserver's children re-import it by default).
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            self._process.start()
        finally:
            sys.modules["__main__"] = main
            for pipe in pipes:
                if pipe is not None:
                    pipe.close()
        self.pid: int = self._process.pid
        for hook in ON_START:
            hook(self)

    @property
    def returncode(self) -> int | None:
        code: int | None = self._process.exitcode
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run(
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    pipes: list[Connection | None],
    session: bool,
) -> None:
    """In the forked child: become ``python *argv`` and exit as it would.

    ``pipes``: its stdout, its stderr (None: the same as stdout) and its stdin
    (None: left as multiprocessing sets it)."""
    if session:
        os.setsid()
    output, errors, given = pipes
    assert output is not None
    os.dup2(output.fileno(), 1)
    os.dup2((errors or output).fileno(), 2)
    if given is not None:
        os.dup2(given.fileno(), 0)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    for pipe in pipes:
        if pipe is not None:
            pipe.close()
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True
    )
    # A child that starts processes of its own may, unlike the daemonic
    # processes multiprocessing knows about.
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, cwd)
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = _exit_status(exit_.code)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would
        traceback.print_exc()
        code = 1
    # What the interpreter does on its way out, which os._exit would skip.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1
