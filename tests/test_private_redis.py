"""The embedded default's private Redis: which server, where its socket goes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from nexus_site import private_redis

pytestmark = pytest.mark.mode_independent


def test_the_server_is_valkeylites_unless_another_is_named(tmp_path: Path) -> None:
    found = private_redis.find_server("")
    assert found.path is not None, found.why_none
    assert os.access(found.path, os.X_OK)

    assert private_redis.find_server("none") == private_redis.ServerBinary(
        None, "NEXUS_REDIS_SERVER is none"
    )
    missing = str(tmp_path / "redis-server")
    assert private_redis.find_server(missing).why_none == (
        f"NEXUS_REDIS_SERVER={missing} is not an executable"
    )
    assert private_redis.find_server(found.path).path == found.path


def test_a_state_directory_too_long_for_a_socket_names_where_it_went(
    tmp_path: Path,
) -> None:
    state_dir = tmp_path / ("s" * 120)
    state_dir.mkdir()
    path = private_redis.socket_path(state_dir)
    assert path.parent != state_dir
    assert len(os.fsencode(path)) <= private_redis.MAX_SOCKET_PATH
    assert private_redis.find_running(state_dir) is None  # nothing answers yet

    binary = private_redis.find_server("").path
    assert binary is not None
    command = private_redis.server_command(binary, path, 16, tmp_path / "redis.log")
    server = subprocess.Popen(command)
    try:
        assert private_redis.wait_until_ready(path, lambda: server.poll() is not None)
        # What a command started beside nexus_run finds (settings).
        assert private_redis.find_running(state_dir) == path
        with pytest.raises(private_redis.SocketInUseError):
            private_redis.clear_stale_socket(path)
    finally:
        server.terminate()
        server.wait(timeout=30)
    private_redis.remove_socket(state_dir, path)
    assert not path.parent.exists()
    assert list(state_dir.iterdir()) == []


def test_a_socket_left_by_a_killed_server_is_cleared(tmp_path: Path) -> None:
    path = private_redis.socket_path(tmp_path)
    binary = private_redis.find_server("").path
    assert binary is not None
    command = private_redis.server_command(binary, path, 16, tmp_path / "redis.log")
    server = subprocess.Popen(command)
    assert private_redis.wait_until_ready(path, lambda: server.poll() is not None)
    server.kill()
    server.wait(timeout=30)
    assert path.exists()

    private_redis.clear_stale_socket(path)

    assert not path.exists()
    assert private_redis.find_running(tmp_path) is None
