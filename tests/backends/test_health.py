"""Health rounds against real mock servers: the state machine as operators see it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import httpx
import openai
import pytest
from django.db import connection
from django.utils import timezone

from backends.health import (
    HealthState,
    Thresholds,
    check_all,
    check_backend,
    next_health,
    read_backend_health,
)
from backends.kinds import ProbeResult, ProbeStatus
from backends.models import Backend, HealthStatus
from routing.versioning import read_config_version
from tests.backends.mock_fleet import (
    KindMock,
    blackhole,
    closed_port_url,
    running_mocks,
    start_kind_mock,
)
from tests.conftest import NexusServer, start_mock_backend
from tests.factories import BackendFactory, BackendModelFactory

UP = ProbeResult(ProbeStatus.UP, latency_ms=10.0)
DOWN = ProbeResult(ProbeStatus.DOWN, error="connection refused")
LOADING = ProbeResult(ProbeStatus.LOADING, latency_ms=1.0, error="loading")
RULES = Thresholds(failures=3, recoveries=2, latency_alpha=0.5)


def run(state: HealthState, *results: ProbeResult) -> list[str]:
    statuses = []
    for result in results:
        state = next_health(state, result, RULES)
        statuses.append(str(state.status))
    return statuses


# The state machine, probe by probe.


def test_an_unknown_backend_is_healthy_after_one_good_probe() -> None:
    assert run(HealthState(HealthStatus.UNKNOWN), UP) == ["healthy"]


def test_a_healthy_backend_turns_unhealthy_on_the_nth_failure_in_a_row() -> None:
    assert run(HealthState(HealthStatus.HEALTHY), DOWN, DOWN, UP, DOWN, DOWN, DOWN) == [
        "healthy",
        "healthy",
        "healthy",
        "healthy",
        "healthy",
        "unhealthy",
    ]


def test_an_unhealthy_backend_needs_m_good_probes_in_a_row() -> None:
    assert run(HealthState(HealthStatus.UNHEALTHY), UP, DOWN, UP, UP) == [
        "unhealthy",
        "unhealthy",
        "unhealthy",
        "healthy",
    ]


def test_an_unknown_backend_that_never_answers_turns_unhealthy() -> None:
    assert run(HealthState(HealthStatus.UNKNOWN), DOWN, DOWN, DOWN) == [
        "unknown",
        "unknown",
        "unhealthy",
    ]


def test_only_the_operator_ends_draining() -> None:
    draining = HealthState(HealthStatus.DRAINING)
    assert run(draining, DOWN, DOWN, DOWN, DOWN, UP, UP, UP) == ["draining"] * 7


def test_loading_neither_fails_nor_recovers_a_backend() -> None:
    healthy = HealthState(HealthStatus.HEALTHY, consecutive_failures=2)
    state = next_health(healthy, LOADING, RULES)
    assert state.status == HealthStatus.HEALTHY
    assert state.consecutive_failures == 0
    assert state.last_error == "loading"
    assert run(HealthState(HealthStatus.UNHEALTHY), UP, LOADING, UP) == [
        "unhealthy",
        "unhealthy",
        "unhealthy",
    ]
    assert run(HealthState(HealthStatus.UNKNOWN), LOADING, LOADING) == ["unknown"] * 2


def test_latency_is_an_average_of_good_probes_and_errors_clear() -> None:
    state = HealthState(HealthStatus.HEALTHY, avg_latency_ms=100.0)
    state = next_health(state, ProbeResult(ProbeStatus.UP, latency_ms=200.0), RULES)
    assert state.avg_latency_ms == 150.0
    state = next_health(state, DOWN, RULES)
    assert (state.avg_latency_ms, state.last_error) == (150.0, "connection refused")
    state = next_health(state, UP, RULES)
    assert state.last_error == ""


# Rounds against real servers.


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, KindMock]]:
    specs = (
        ("openai", "--models", "llama3:8b", "--api-key", "sk-upstream-Zq8v3LmT0pXw"),
        ("ollama", "--models", "llama3:8b,llava:7b", "--loaded-models", "llama3:8b"),
        ("vllm", "--models", "llama3:8b"),
        ("llamacpp", "--models", "llama3:8b"),
        ("anthropic", "--models", "claude-sonnet-4", "--api-key", "sk-ant-key-0001"),
    )
    with running_mocks(*specs) as mocks:
        yield {mock.kind: mock for mock in mocks}


@pytest.fixture(autouse=True)
def _patient_probes(settings: Any) -> None:
    # A live mock always answers; a machine loaded by the rest of the suite
    # has been seen to stall a probe past the 5 s default. Tests of timeouts
    # set their own.
    settings.NEXUS_HEALTH_PROBE_TIMEOUT = 15.0


@pytest.fixture(autouse=True)
def _fresh_mocks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "fleet" in request.fixturenames:
        for mock in request.getfixturevalue("fleet").values():
            mock.reset()


def refreshed(backend: Backend) -> Backend:
    backend.refresh_from_db()
    return backend


@pytest.mark.django_db
def test_every_kind_of_running_backend_becomes_healthy(
    fleet: dict[str, KindMock],
) -> None:
    keys = {"openai": "sk-upstream-Zq8v3LmT0pXw", "anthropic": "sk-ant-key-0001"}
    for kind, mock in fleet.items():
        mock.register(f"{kind}-1", api_key=keys.get(kind, ""))
    reports = check_all()
    assert {r.name: r.status for r in reports} == {
        f"{kind}-1": "healthy" for kind in fleet
    }
    for backend in Backend.objects.all():
        assert backend.last_check_at is not None
        assert backend.avg_latency_ms is not None
        assert backend.consecutive_successes == 1
        assert backend.last_error == ""


@pytest.mark.django_db
def test_a_stopped_backend_turns_unhealthy_after_n_rounds_and_back_after_m(
    settings: Any,
) -> None:
    settings.NEXUS_HEALTH_FAILURE_THRESHOLD = 3
    settings.NEXUS_HEALTH_RECOVERY_THRESHOLD = 2
    mock = start_kind_mock("openai", "--models", "llama3:8b")
    port = mock.process.port
    backend = mock.register("gpu-1")
    try:
        check_all()
        assert refreshed(backend).status == HealthStatus.HEALTHY
        mock.stop()
        seen = []
        for _ in range(3):
            check_all()
            seen.append(refreshed(backend).status)
        assert seen == ["healthy", "healthy", "unhealthy"]
        assert backend.last_error == "connection refused"
        assert backend.consecutive_failures == 3

        mock = start_kind_mock("openai", "--models", "llama3:8b", "--port", str(port))
        seen = []
        for _ in range(2):
            check_all()
            seen.append(refreshed(backend).status)
        assert seen == ["unhealthy", "healthy"]
        assert backend.last_error == ""
    finally:
        mock.stop()


@pytest.mark.django_db
def test_a_new_backends_first_failure_leaves_it_unknown_not_unhealthy(
    settings: Any,
) -> None:
    # What the README promises (issue 12, item 13): a backend added with a
    # typo in its URL is not branded unhealthy by one failed probe.
    settings.NEXUS_HEALTH_FAILURE_THRESHOLD = 3
    backend = Backend.objects.create(name="new-gpu", base_url=closed_port_url())
    assert backend.status == HealthStatus.UNKNOWN  # as the admin creates it
    (report,) = check_all()
    assert refreshed(backend).status == HealthStatus.UNKNOWN
    assert report.progress == "failing (1 of 3 failures)"
    assert backend.last_error == "connection refused"
    check_all()
    assert refreshed(backend).status == HealthStatus.UNKNOWN
    check_all()
    assert refreshed(backend).status == HealthStatus.UNHEALTHY


@pytest.mark.django_db
def test_llamacpp_loading_its_model_is_not_a_failure(
    fleet: dict[str, KindMock], settings: Any
) -> None:
    settings.NEXUS_HEALTH_FAILURE_THRESHOLD = 1
    mock = fleet["llamacpp"]
    fresh = mock.register("loading-new")
    running = mock.register("loading-again", status=HealthStatus.HEALTHY)
    mock.configure(loading=True)
    for _ in range(3):
        check_all()
    for backend in (fresh, running):
        refreshed(backend)
        assert backend.consecutive_failures == 0
        assert "loading" in backend.last_error
    assert fresh.status == HealthStatus.UNKNOWN
    assert running.status == HealthStatus.HEALTHY
    mock.configure(loading=False)
    check_all()
    assert refreshed(fresh).status == HealthStatus.HEALTHY
    assert fresh.last_error == ""


@pytest.mark.django_db
def test_a_draining_backend_stays_draining_whatever_the_probes(
    fleet: dict[str, KindMock], settings: Any
) -> None:
    settings.NEXUS_HEALTH_FAILURE_THRESHOLD = 1
    up = fleet["vllm"].register("up", status=HealthStatus.DRAINING)
    down = BackendFactory(base_url=closed_port_url(), status=HealthStatus.DRAINING)
    check_all()
    assert refreshed(up).status == HealthStatus.DRAINING
    assert up.avg_latency_ms is not None
    assert refreshed(down).status == HealthStatus.DRAINING
    assert down.last_error == "connection refused"


@pytest.mark.django_db
def test_a_wrong_key_is_reported_without_revealing_any_key(
    fleet: dict[str, KindMock], settings: Any
) -> None:
    settings.NEXUS_HEALTH_FAILURE_THRESHOLD = 1
    backend = fleet["openai"].register("openai-bad-key", api_key="sk-wrong-Qq7r2Kd")
    (report,) = check_all()
    assert report.status == "unhealthy"
    assert "authentication failed" in refreshed(backend).last_error
    assert "sk-" not in backend.last_error
    assert "sk-" not in str(report.as_dict())


@pytest.mark.django_db
def test_disabled_backends_are_checked_only_when_named(
    fleet: dict[str, KindMock],
) -> None:
    backend = fleet["vllm"].register("off", enabled=False)
    assert check_all() == []
    assert refreshed(backend).last_check_at is None
    report = check_backend(backend.pk)
    assert report.status == "healthy", report.error


@pytest.mark.django_db
def test_the_ollama_round_keeps_loaded_models_current(
    fleet: dict[str, KindMock],
) -> None:
    mock = fleet["ollama"]
    backend = mock.register("ollama-1")
    llama = BackendModelFactory(backend=backend, name="llama3:8b", loaded=False)
    llava = BackendModelFactory(backend=backend, name="llava:7b", loaded=True)
    check_all()
    assert (refreshed(llama).loaded, refreshed(llava).loaded) == (True, False)
    mock.configure(loaded_models=["llava:7b"])
    check_all()
    assert (refreshed(llama).loaded, refreshed(llava).loaded) == (False, True)


# pytest-django runs transactional tests last, after the module's fleet is gone:
# these start the few mocks they need.


@pytest.mark.django_db(transaction=True)
def test_status_changes_bump_the_routing_version_and_refreshes_do_not() -> None:
    with running_mocks(("vllm", "--models", "m")) as (mock,):
        mock.register("vllm-1")
        before = read_config_version()
        check_all()  # unknown -> healthy
        assert read_config_version() == before + 1
        check_all()  # healthy -> healthy: only latency and check time change
        assert read_config_version() == before + 1


@pytest.mark.django_db
def test_a_round_over_100_backends_takes_about_one_probe_timeout(
    settings: Any,
) -> None:
    # Long enough that a loaded machine still answers the 70 live probes and
    # refuses the 10 closed ports in time (5 s was not, twice, with the rest of
    # the suite beside it, nor 10 s once at load 15); short beside 20 silent
    # probes in turn (300 s).
    settings.NEXUS_HEALTH_PROBE_TIMEOUT = 15.0
    refused = closed_port_url()
    with (
        running_mocks(
            ("openai", "--models", "m"), ("ollama", "--models", "m")
        ) as mocks,
        blackhole() as silent,
    ):
        targets = (
            [(mocks[0].base_url, "openai")] * 40
            + [(mocks[1].base_url, "ollama")] * 30
            + [(silent, "openai")] * 20
            + [(refused, "vllm")] * 10
        )
        Backend.objects.bulk_create(
            Backend(name=f"b{i:03}", base_url=url, kind=kind)
            for i, (url, kind) in enumerate(targets)
        )
        started = time.monotonic()
        reports = check_all()
        elapsed = time.monotonic() - started
    # Probed one after another, the 20 silent backends alone would take 300 s.
    assert elapsed < 15.0 + 15.0, elapsed
    assert len(reports) == 100
    by_error: dict[str, int] = {}
    for report in reports:
        by_error[report.error] = by_error.get(report.error, 0) + 1
    assert by_error == {
        "": 70,
        "no answer within 15 s": 20,
        "connection refused": 10,
    }
    assert Backend.objects.filter(status=HealthStatus.HEALTHY).count() == 70


@pytest.mark.django_db(transaction=True)
def test_overlapping_rounds_count_each_moment_once(settings: Any) -> None:
    settings.NEXUS_HEALTH_PROBE_TIMEOUT = 0.5
    with (
        running_mocks(("openai", "--models", "m", "--latency-ms", "300")) as (slow,),
        blackhole() as silent,
    ):
        up = slow.register("slow-but-up")
        down = BackendFactory(name="silent", base_url=silent, status="healthy")
        start = threading.Barrier(2)

        def round_in_thread() -> None:
            try:
                start.wait()
                check_all()
            finally:
                connection.close()

        with ThreadPoolExecutor(2) as pool:
            rounds = [pool.submit(round_in_thread) for _ in range(2)]
            for future in rounds:
                future.result(timeout=30)  # re-raises what the round raised
        # Both rounds saw the same moment: it counts once, and nothing is lost.
        assert (refreshed(up).status, up.consecutive_successes) == ("healthy", 1)
        assert (refreshed(down).status, down.consecutive_failures) == ("healthy", 1)
        check_all()
        assert refreshed(up).consecutive_successes == 2
        assert refreshed(down).consecutive_failures == 2


@pytest.mark.django_db(transaction=True)
def test_traffic_follows_health_through_the_gateway(
    nexus_server_factory: Callable[..., NexusServer], settings: Any
) -> None:
    settings.NEXUS_HEALTH_FAILURE_THRESHOLD = 1
    settings.NEXUS_HEALTH_RECOVERY_THRESHOLD = 2
    a = start_mock_backend("--models", "llama3:8b", "--name", "mock-a")
    b = start_mock_backend("--models", "llama3:8b", "--name", "mock-b")
    try:
        for process, priority in ((a, 1), (b, 2)):
            backend = BackendFactory(
                name=process.base_url.rsplit(":", 1)[1],
                base_url=process.base_url,
                priority=priority,
                status=HealthStatus.UNKNOWN,
            )
            BackendModelFactory(backend=backend, name="llama3:8b")
        check_all()
        server = nexus_server_factory(
            NEXUS_AUTH_REQUIRED="false",
            NEXUS_CONFIG_POLL_INTERVAL="0.1",
            NEXUS_ROUTING_STRATEGY="priority_only",
        )
        client = openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        )

        def answerer() -> str:
            reply = client.chat.completions.create(
                model="llama3:8b", messages=[{"role": "user", "content": "hi"}]
            )
            content = reply.choices[0].message.content or ""
            return content.split("/", 1)[0].lstrip("[")

        def eventually(expected: str) -> None:
            deadline = time.monotonic() + 10
            while (seen := answerer()) != expected:
                assert time.monotonic() < deadline, f"still served by {seen}"
                time.sleep(0.05)

        assert answerer() == "mock-a"
        a_mock = KindMock("openai", a, httpx.Client(base_url=a.base_url))
        a_mock.refuse()
        check_all()  # mock-a is unhealthy now
        a_mock.listen()
        # mock-a answers again, but health says no: the gateway sends traffic to b.
        eventually("mock-b")
        check_all()  # one good probe of the two needed
        time.sleep(0.5)  # longer than the gateway's config poll
        assert answerer() == "mock-b"
        check_all()
        eventually("mock-a")
        a_mock.http.close()
    finally:
        a.stop()
        b.stop()


@pytest.mark.django_db
def test_recorded_health_is_read_by_name_with_short_errors() -> None:
    checked_at = datetime(2025, 3, 1, 12, 30, tzinfo=UTC)
    BackendFactory(
        name="b-gpu",
        status=HealthStatus.UNHEALTHY,
        last_check_at=checked_at,
        last_error="x" * 250,
        avg_latency_ms=12.5,
    )
    BackendFactory(name="a-cpu", enabled=False)
    BackendFactory(
        name="c-fresh", status=HealthStatus.HEALTHY, last_check_at=timezone.now()
    )
    rows = read_backend_health()
    assert [row["name"] for row in rows] == ["a-cpu", "b-gpu", "c-fresh"]
    assert rows[0]["last_check_at"] is None
    assert rows[1] == {
        "name": "b-gpu",
        "enabled": True,
        "status": "unhealthy",
        "avg_latency_ms": 12.5,
        "prefix_cache_hit_rate": None,  # its server never said
        "last_check_at": "2025-03-01T12:30:00+00:00",
        # Checked long ago: the dashboard shows it stale, as /health does.
        "stale": True,
        "last_error": "x" * 200,
    }
    assert [row["stale"] for row in (rows[0], rows[2])] == [False, False]
