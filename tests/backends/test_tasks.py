"""The Celery tasks: what they run, and a real worker running them on beat's clock."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from backends.models import Backend, BackendModel, HealthStatus
from backends.tasks import check_backends_health
from tests.backends.mock_fleet import running_mocks
from tests.conftest import REPO_ROOT, server_env, wait_until


@pytest.mark.django_db
def test_a_health_round_lists_the_models_of_backends_that_came_up() -> None:
    with running_mocks(("ollama", "--models", "llama3:8b,llava:7b")) as (mock,):
        backend = mock.register("ollama-1")
        check_backends_health()
        assert set(backend.models.values_list("name", flat=True)) == {
            "llama3:8b",
            "llava:7b",
        }
        # Discovery proper runs on its own schedule: a round of a backend that
        # stays up does not list its models again.
        mock.configure(models=["llama3:8b", "llava:7b", "phi-4"])
        check_backends_health()
        assert backend.models.count() == 2


def test_beat_schedules_health_rounds_and_discovery() -> None:
    schedule = settings.CELERY_BEAT_SCHEDULE
    health = schedule["check-backend-health"]
    assert health["task"] == "backends.tasks.check_backends_health"
    assert health["schedule"] == settings.NEXUS_HEALTH_INTERVAL
    discovery = schedule["discover-backend-models"]
    assert discovery["task"] == "backends.tasks.discover_backend_models"
    assert discovery["schedule"] == settings.NEXUS_DISCOVERY_INTERVAL


@pytest.fixture
def celery_processes(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """A worker and beat on the test database, beat firing health every 0.5 s."""
    env = server_env() | {
        # Its own broker folder and beat schedule (embedded mode), so that
        # nothing else's tasks or state leak in.
        "NEXUS_STATE_DIR": str(tmp_path),
        "NEXUS_HEALTH_INTERVAL": "0.5",
        "NEXUS_HEALTH_PROBE_TIMEOUT": "2",
    }
    extra = () if settings.REDIS_URL else ("--without-mingle", "--without-gossip")
    commands = {
        "worker": [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "nexus_site",
            "worker",
            "--pool",
            "threads",
            "--concurrency",
            "2",
            "--loglevel",
            "INFO",
            "--hostname",
            f"health-test-{uuid.uuid4().hex[:8]}@%h",
            *extra,
        ],
        "beat": [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "nexus_site",
            "beat",
            "--loglevel",
            "INFO",
            "--schedule",
            str(tmp_path / "beat-schedule"),
        ],
    }
    processes = []
    for name, command in commands.items():
        log = (tmp_path / f"{name}.log").open("w")
        processes.append(
            subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    yield processes
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            # Nothing to finish: do not wait out a warm shutdown.
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.django_db(transaction=True)
def test_a_celery_worker_runs_the_beat_scheduled_health_round(
    celery_processes: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    with running_mocks(("ollama", "--models", "llama3:8b")) as (mock,):
        backend = mock.register("ollama-1")
        seen: set[object] = set()
        deadline = time.monotonic() + 60
        # Two different check times: beat fired at least twice, and a worker
        # ran the round each time.
        while len(seen) < 2:
            backend.refresh_from_db()
            if backend.last_check_at is not None:
                seen.add(backend.last_check_at)
            if time.monotonic() > deadline:
                logs = "".join(
                    path.read_text()[-3000:] for path in tmp_path.glob("*.log")
                )
                pytest.fail(f"no health round ran; logs:\n{logs}")
            assert all(p.poll() is None for p in celery_processes)
            time.sleep(0.1)
        assert backend.status == HealthStatus.HEALTHY
        # The round that brought it up also lists its models, after the
        # health results are saved (a loaded machine's worker may still be at
        # it when the next round, on another worker, has saved its check).
        wait_until(
            BackendModel.objects.filter(
                backend=backend, name="llama3:8b", discovered=True
            ).exists,
            timeout=30,
            what="the models listed",
        )
    assert Backend.objects.count() == 1
