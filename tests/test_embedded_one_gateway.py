"""The embedded default is one gateway: `nexus_run --workers 2` with nothing set.

Real `nexus_run` processes in a fresh state directory, with neither
DATABASE_URL nor REDIS_URL: the launcher's private Redis makes the two serving
processes share one limit per key, one dashboard and one usage pipeline; with
no Redis server to start, it serves with one process and says why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import zygote
from tests.conftest import wait_until
from tests.test_nexus_run import REPO_ROOT, RunningNexus, _login, _start
from usage.models.keys import PREFIX_LENGTH

# Each test runs the embedded default whatever the suite's mode: once is enough.
pytestmark = pytest.mark.mode_independent

REQUESTS = 12
RPM = 5


@pytest.fixture
def embedded_env(tmp_path: Path) -> dict[str, str]:
    """The embedded default, whatever mode the suite runs in."""
    env = dict(os.environ)
    for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS"):
        env.pop(name, None)
    for name in ("NEXUS_ADMIN_PASSWORD", "NEXUS_DEMO", "NEXUS_REDIS_SERVER"):
        env.pop(name, None)
    env["NEXUS_STATE_DIR"] = str(tmp_path / "state")
    return env


@pytest.fixture
def limited_key(embedded_env: dict[str, str]) -> tuple[str, str]:
    """A key with RPM requests a minute, made before the gateway starts (so
    that both serving processes know it from their first request)."""
    zygote.run(
        [sys.executable, "manage.py", "migrate", "-v0"],
        cwd=REPO_ROOT,
        env=embedded_env,
        timeout=120,
        check=True,
    )
    return _create_key(embedded_env, "--rpm", str(RPM))


@contextlib.contextmanager
def _running(env: dict[str, str], *args: str) -> Iterator[RunningNexus]:
    nexus = _start(env, *args)
    try:
        yield nexus
    finally:
        # A failed test still stops every child (its Redis included): the
        # launcher's Ctrl-C does; a SIGKILL would leave them running.
        if nexus.process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                nexus.interrupt()
        if nexus.process.poll() is None:
            os.killpg(nexus.process.pid, signal.SIGKILL)


def _create_key(env: dict[str, str], *args: str) -> tuple[str, str]:
    """Create a key with `nexus_create_key`; return it and its prefix."""
    result = zygote.run(
        [sys.executable, "manage.py", "nexus_create_key", "test", "--json", *args],
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
        check=True,
    )
    created = json.loads(result.stdout)
    return created["key"], created["prefix"]


def _chat(base: str, key: str) -> int:
    # A connection of its own each: the kernel hands them to either process.
    response = httpx.post(
        f"{base}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "llama3:8b", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    return response.status_code


def _requests_in_metrics(base: str) -> int:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(
        round(float(value))
        for value in re.findall(
            r'^nexus_requests_total\{[^}]*surface="[^"]*"[^}]*\} (\S+)',
            text,
            re.MULTILINE,
        )
    )


def _records(state_dir: Path, prefix: str) -> list[int]:
    """The statuses of the key's usage records in the embedded database."""
    with sqlite3.connect(state_dir / "nexus.sqlite3", timeout=20) as db:
        rows = db.execute(
            "select status from usage_usagerecord where api_key_prefix = ?",
            (prefix,),
        ).fetchall()
    return sorted(status for (status,) in rows)


class LiveUsage:
    """The dashboard's live stream (/api/usage-stream), read in a thread."""

    def __init__(self, client: httpx.Client) -> None:
        self.latest: dict | None = None
        self._client = client
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        # Until the client is closed (the test's end).
        with (
            contextlib.suppress(httpx.HTTPError),
            self._client.stream("GET", "/api/usage-stream") as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data:"):
                    self.latest = json.loads(line[5:])


def test_two_serving_processes_share_one_limit_dashboard_and_usage(
    embedded_env: dict[str, str], limited_key: tuple[str, str]
) -> None:
    key, prefix = limited_key
    state_dir = Path(embedded_env["NEXUS_STATE_DIR"])
    with _running(embedded_env, "--workers", "2") as nexus:
        password = nexus.expect(r"user 'admin' password (\S+) \(printed once")[1]
        nexus.expect(r"Serving with daphne: 2 processes on one port")
        nexus.expect(r"Shared state:\s+private Redis")
        nexus.expect(r"Press Ctrl-C to stop")
        base = f"http://127.0.0.1:{nexus.port}"

        statuses = [_chat(base, key) for _ in range(REQUESTS)]

        # One bucket for the gateway: exactly RPM answered, the rest refused.
        assert statuses == [200] * RPM + [429] * (REQUESTS - RPM)
        with _login(base, "admin", password) as admin:
            live = LiveUsage(admin)
            answered = _requests_in_metrics(base)
            event = wait_until(
                lambda: (
                    live.latest
                    if live.latest
                    and len(live.latest["processes"]) == 2
                    and _live_requests(live.latest) >= answered
                    else None
                ),
                timeout=30,
                what="the dashboard's live usage of both processes",
            )
            # Both processes' counters, summed: what /metrics says was answered.
            assert _live_requests(event) == answered >= REQUESTS
        wait_until(
            lambda: len(_records(state_dir, prefix)) == REQUESTS,
            timeout=30,
            what="the usage records of every request",
        )
        assert _records(state_dir, prefix) == [200] * RPM + [429] * (REQUESTS - RPM)

        # A command run beside it joins its Redis: the flush drains the usage
        # stream the serving processes ship to.
        flush = _manage(embedded_env, "nexus_flush_usage")
        assert "usage events from Redis" in flush.stdout, flush.stdout
        # A second launcher on the same state directory is refused.
        second = _manage(embedded_env, "nexus_run", "--port", str(nexus.port + 1))
        assert second.returncode == 1
        assert "Another nexus_run serves from" in second.stderr

        assert nexus.interrupt() == 0
        assert "Stopped." in nexus.output()


def _manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return zygote.run(
        [sys.executable, "manage.py", *args], cwd=REPO_ROOT, env=env, timeout=120
    )


def _live_requests(event: dict) -> int:
    return sum(row["requests"] for row in event["series"])


def test_usage_still_in_redis_at_ctrl_c_is_written(
    embedded_env: dict[str, str],
) -> None:
    with _running(embedded_env, "--workers", "2") as nexus:
        key = nexus.expect(r"Demo API key:\s+(nx-\S+)")[1]
        nexus.expect(r"Press Ctrl-C to stop")
        base = f"http://127.0.0.1:{nexus.port}"
        assert [_chat(base, key) for _ in range(4)] == [200] * 4

        assert nexus.interrupt() == 0  # at once: the worker may not have drained

    state_dir = Path(embedded_env["NEXUS_STATE_DIR"])
    assert _records(state_dir, key[:PREFIX_LENGTH]) == [200] * 4


def test_without_a_redis_server_it_serves_with_one_process_and_says_why(
    embedded_env: dict[str, str], limited_key: tuple[str, str]
) -> None:
    key, _ = limited_key
    missing = str(Path(embedded_env["NEXUS_STATE_DIR"]) / "no-such-redis-server")
    env = embedded_env | {"NEXUS_REDIS_SERVER": missing}
    with _running(env, "--workers", "2") as nexus:
        nexus.expect(r"Press Ctrl-C to stop")
        output = nexus.output()
        assert "Serving with daphne: 1 process on one port" in output
        assert f"NEXUS_REDIS_SERVER={missing} is not an executable" in output
        assert "one serving process, not 2" in output
        base = f"http://127.0.0.1:{nexus.port}"

        statuses = [_chat(base, key) for _ in range(RPM + 1)]

        assert statuses == [200] * RPM + [429]
        assert nexus.interrupt() == 0
