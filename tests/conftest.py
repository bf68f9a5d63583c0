"""Shared fixtures: the mode guard and real mock-backend processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_LINE = re.compile(r"listening on (http://\S+)")


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


@dataclass
class MockBackendProcess:
    """A running ``manage.py nexus_mock_backend`` child process."""

    process: subprocess.Popen[str]
    base_url: str

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_mock_backend(*args: str, timeout: float = 20.0) -> MockBackendProcess:
    """Start a mock backend on a free port and wait until it accepts requests."""
    cmd = [sys.executable, "manage.py", "nexus_mock_backend", "--port", "0", *args]
    process = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    assert process.stdout is not None
    seen: list[str] = []
    # Reading line by line blocks until the server prints its address or exits.
    for line in process.stdout:
        seen.append(line)
        match = READY_LINE.search(line)
        if match:
            return MockBackendProcess(process=process, base_url=match.group(1))
    process.wait(timeout=timeout)
    raise RuntimeError(f"mock backend did not start: {''.join(seen)}")


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
