"""manage.py nexus_check_health and nexus_discover_models, as operators run them."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
from django.core.management import CommandError, call_command

from backends.models import Backend, BackendModel, HealthStatus
from tests.backends.mock_fleet import KindMock, closed_port_url, running_mocks
from tests.factories import BackendFactory

pytestmark = pytest.mark.django_db

SECRET = "sk-upstream-Zq8v3LmT0pXw"


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, KindMock]]:
    with running_mocks(
        ("ollama", "--models", "llama3:8b,llava:7b"),
        ("vllm", "--models", "qwen2.5:72b", "--api-key", SECRET),
    ) as mocks:
        yield {mock.kind: mock for mock in mocks}


def run(command: str, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command(command, *args, stdout=out, stderr=err)
    except SystemExit as exit_:
        return int(exit_.code or 0), out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()


def test_check_health_prints_a_table_and_exits_0_when_all_are_healthy(
    fleet: dict[str, KindMock],
) -> None:
    fleet["ollama"].register("ollama-1", priority=1)
    fleet["vllm"].register("vllm-1", priority=2, api_key=SECRET)
    code, out, _ = run("nexus_check_health")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "NAME",
        "KIND",
        "VERSION",
        "STATUS",
        "LATENCY",
        "MODELS",
        "ERROR",
    ]
    assert lines[1].split()[:4] == ["ollama-1", "ollama", "0.6.8", "healthy"]
    assert lines[1].split()[5] == "ms"
    assert lines[2].split()[:4] == ["vllm-1", "vllm", "0.8.5", "healthy"]
    assert SECRET not in out
    assert Backend.objects.filter(status=HealthStatus.HEALTHY).count() == 2


def test_check_health_exits_1_naming_the_failing_backends(
    fleet: dict[str, KindMock],
) -> None:
    fleet["ollama"].register("ollama-1")
    BackendFactory(name="dead", base_url=closed_port_url(), status="unknown")
    code, out, err = run("nexus_check_health")
    assert code == 1
    dead_line = next(line for line in out.splitlines() if line.startswith("dead"))
    assert dead_line.split()[2:4] == ["-", "unknown"]
    assert dead_line.endswith("connection refused")
    assert err.strip() == "Not healthy: dead"


def test_a_recovering_backend_is_shown_pending_not_unhealthy(
    fleet: dict[str, KindMock],
) -> None:
    fleet["ollama"].register("ollama-1", status=HealthStatus.UNHEALTHY)
    BackendFactory(
        name="dying", base_url=closed_port_url(), status=HealthStatus.HEALTHY
    )
    code, out, _ = run("nexus_check_health")
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "pending (1 of 2 successes)" in lines["ollama-1"]
    assert "unhealthy" not in lines["ollama-1"]
    assert lines["dying"].split()[3] == "healthy"
    assert code == 1  # not healthy yet
    code, out, _ = run("nexus_check_health", "--json")
    reports = {r["name"]: r for r in json.loads(out)}
    assert reports["ollama-1"]["status"] == "healthy"
    assert reports["dying"]["progress"] == "failing (2 of 3 failures)"


def test_check_health_json_for_one_backend(fleet: dict[str, KindMock]) -> None:
    fleet["ollama"].register("ollama-1")
    fleet["vllm"].register("vllm-1", api_key="sk-wrong", enabled=False)
    code, out, _ = run("nexus_check_health", "--backend", "vllm-1", "--json")
    (report,) = json.loads(out)
    assert code == 1
    assert report["name"] == "vllm-1"
    assert report["probe"] == "down"
    assert "authentication failed" in report["error"]
    assert "sk-wrong" not in out
    assert Backend.objects.get(name="ollama-1").last_check_at is None


def test_an_unknown_backend_name_is_a_clear_error() -> None:
    BackendFactory(name="gpu-1")
    with pytest.raises(CommandError, match="No backend named 'gpu-9'.*gpu-1"):
        call_command("nexus_check_health", "--backend", "gpu-9")
    with pytest.raises(CommandError, match="No backend named 'gpu-9'"):
        call_command("nexus_discover_models", "--backend", "gpu-9")


def test_check_health_with_nothing_to_check_says_so() -> None:
    code, out, _ = run("nexus_check_health")
    assert (code, out.strip()) == (0, "No enabled backends to check.")


def test_discover_models_reports_each_backend(fleet: dict[str, KindMock]) -> None:
    fleet["ollama"].register("ollama-1")
    fleet["vllm"].register("vllm-1", api_key=SECRET)
    code, out, _ = run("nexus_discover_models")
    assert code == 0
    assert "ollama-1  2 models; added llama3:8b, llava:7b" in out
    assert "vllm-1    1 model; added qwen2.5:72b" in out
    assert BackendModel.objects.filter(discovered=True).count() == 3
    code, out, _ = run("nexus_discover_models", "--backend", "vllm-1", "--json")
    (report,) = json.loads(out)
    assert (code, report["models"], report["added"]) == (0, ["qwen2.5:72b"], [])


def test_discover_models_exits_1_when_a_backend_cannot_be_listed() -> None:
    BackendFactory(name="dead", base_url=closed_port_url())
    code, out, err = run("nexus_discover_models")
    assert code == 1
    assert "dead  not listed: connection refused" in out
    assert err.strip() == "Could not list: dead"
