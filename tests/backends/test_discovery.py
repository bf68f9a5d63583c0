"""Model discovery against real mock servers: upserts that respect the operator."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from backends.discovery import discover_models
from backends.models import Backend, BackendModel
from routing.versioning import read_config_version
from tests.backends.mock_fleet import KindMock, closed_port_url, running_mocks
from tests.factories import BackendFactory, BackendModelFactory


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, KindMock]]:
    specs = (
        (
            "ollama",
            "--models",
            "llama3:8b,llava:7b",
            "--vision-models",
            "llava:7b",
            "--tool-models",
            "llama3:8b",
            "--loaded-models",
            "llama3:8b",
            "--context-length",
            "4096",
        ),
        ("vllm", "--models", "qwen2.5:72b", "--context-length", "32768"),
        ("llamacpp", "--models", "phi-4", "--context-length", "16384"),
        ("openai", "--models", "gpt-4o,gpt-4o-mini"),
        ("anthropic", "--models", "claude-sonnet-4", "--api-key", "sk-ant-key-0001"),
    )
    with running_mocks(*specs) as mocks:
        yield {mock.kind: mock for mock in mocks}


@pytest.fixture(autouse=True)
def _fresh_mocks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "fleet" in request.fixturenames:
        for mock in request.getfixturevalue("fleet").values():
            mock.reset()


def models_of(backend: Backend) -> dict[str, dict[str, Any]]:
    return {
        row["name"]: row
        for row in BackendModel.objects.filter(backend=backend).values(
            "name",
            "context_length",
            "supports_vision",
            "supports_tools",
            "supports_json_mode",
            "loaded",
            "discovered",
            "enabled",
            "manual_fields",
        )
    }


@pytest.mark.django_db
def test_discovery_adds_what_each_kind_reports(fleet: dict[str, KindMock]) -> None:
    ollama = fleet["ollama"].register("ollama-1")
    vllm = fleet["vllm"].register("vllm-1")
    llamacpp = fleet["llamacpp"].register("llamacpp-1")
    openai = fleet["openai"].register("openai-1")
    reports = {r.name: r for r in discover_models()}
    assert reports["ollama-1"].added == ["llama3:8b", "llava:7b"]
    found = models_of(ollama)
    assert found["llama3:8b"] | {"manual_fields": None} == {
        "name": "llama3:8b",
        "context_length": 4096,
        "supports_vision": False,
        "supports_tools": True,
        "supports_json_mode": True,
        "loaded": True,
        "discovered": True,
        "enabled": True,
        "manual_fields": None,
    }
    assert found["llava:7b"]["supports_vision"] is True
    assert found["llava:7b"]["loaded"] is False
    assert models_of(vllm)["qwen2.5:72b"]["context_length"] == 32768
    assert models_of(llamacpp)["phi-4"]["context_length"] == 16384
    assert set(models_of(openai)) == {"gpt-4o", "gpt-4o-mini"}
    assert models_of(openai)["gpt-4o"]["context_length"] is None


@pytest.mark.django_db
def test_fields_set_by_hand_survive_discovery(fleet: dict[str, KindMock]) -> None:
    backend = fleet["ollama"].register("ollama-1")
    discover_models()
    row = BackendModel.objects.get(backend=backend, name="llama3:8b")
    # As the admin records an operator's edit.
    row.context_length = 2048
    row.supports_vision = True
    row.manual_fields = ["context_length", "supports_vision"]
    row.save()
    fleet["ollama"].configure(context_length=8192, tool_models=[])
    (report,) = discover_models()
    row.refresh_from_db()
    assert (row.context_length, row.supports_vision) == (2048, True)
    # What the operator did not touch still follows the backend.
    assert row.supports_tools is False
    assert report.updated == ["llama3:8b", "llava:7b"]
    assert models_of(backend)["llava:7b"]["context_length"] == 8192


@pytest.mark.django_db
def test_a_model_added_by_hand_is_adopted_keeping_what_was_set(
    fleet: dict[str, KindMock],
) -> None:
    backend = fleet["ollama"].register("ollama-1")
    BackendModelFactory(
        backend=backend, name="llava:7b", context_length=1024, supports_tools=True
    )
    BackendModelFactory(backend=backend, name="not-on-the-server", context_length=10)
    (report,) = discover_models()
    found = models_of(backend)
    llava = found["llava:7b"]
    assert llava["discovered"] is True
    assert sorted(llava["manual_fields"]) == ["context_length", "supports_tools"]
    assert (llava["context_length"], llava["supports_tools"]) == (1024, True)
    # Only what the operator left at its default is filled in.
    assert llava["supports_vision"] is True
    assert report.added == ["llama3:8b"]
    # A model added by hand that the server never listed is left alone.
    assert found["not-on-the-server"]["enabled"] is True
    assert report.disabled == []


@pytest.mark.django_db
def test_vanished_models_are_disabled_and_come_back(fleet: dict[str, KindMock]) -> None:
    mock = fleet["openai"]
    backend = mock.register("openai-1")
    discover_models()
    mock.configure(models=["gpt-4o"])
    (report,) = discover_models()
    assert report.disabled == ["gpt-4o-mini"]
    gone = models_of(backend)["gpt-4o-mini"]
    assert (gone["enabled"], gone["discovered"]) == (False, True)
    mock.configure(models=["gpt-4o", "gpt-4o-mini"])
    (report,) = discover_models()
    assert report.enabled == ["gpt-4o-mini"]
    assert models_of(backend)["gpt-4o-mini"]["enabled"] is True
    assert BackendModel.objects.filter(backend=backend).count() == 2


@pytest.mark.django_db
def test_a_model_the_operator_disabled_stays_disabled(
    fleet: dict[str, KindMock],
) -> None:
    backend = fleet["openai"].register("openai-1")
    discover_models()
    BackendModel.objects.filter(backend=backend, name="gpt-4o").update(
        enabled=False, manual_fields=["enabled"]
    )
    (report,) = discover_models()
    assert report.enabled == []
    assert models_of(backend)["gpt-4o"]["enabled"] is False


@pytest.mark.django_db
def test_a_backend_that_cannot_be_listed_keeps_its_models(
    fleet: dict[str, KindMock],
) -> None:
    down = BackendFactory(name="down", base_url=closed_port_url(), kind="vllm")
    BackendModelFactory(backend=down, name="kept", discovered=True)
    loading = fleet["llamacpp"].register("loading")
    BackendModelFactory(backend=loading, name="phi-4", discovered=True)
    fleet["llamacpp"].configure(loading=True)
    claude = fleet["anthropic"].register("claude", api_key="sk-ant-key-0001")
    BackendModelFactory(backend=claude, name="claude-sonnet-4")
    reports = {r.name: r for r in discover_models()}
    assert (reports["down"].ok, reports["down"].error) == (False, "connection refused")
    assert not reports["loading"].ok
    assert "loading" in reports["loading"].error
    assert reports["claude"].ok
    assert "configuration" in reports["claude"].summary()
    assert BackendModel.objects.filter(enabled=True).count() == 3


# pytest-django runs transactional tests last, after the module's fleet is gone:
# these start the mock they need.


@pytest.mark.django_db(transaction=True)
def test_discovery_changes_bump_the_routing_version_once() -> None:
    with running_mocks(("ollama", "--models", "llama3:8b,llava:7b")) as (mock,):
        mock.register("ollama-1")
        mock.register("ollama-2")
        before = read_config_version()
        discover_models()
        assert read_config_version() == before + 1
        discover_models()  # nothing changed
        assert read_config_version() == before + 1


@pytest.mark.django_db(transaction=True)
def test_two_discoveries_at_once_leave_one_row_per_model() -> None:
    def discover() -> list[str]:
        try:
            return [name for r in discover_models() for name in r.added]
        finally:
            connection.close()

    with running_mocks(("ollama", "--models", "llama3:8b,llava:7b")) as (mock,):
        backend = mock.register("ollama-1")
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(discover) for _ in range(2)]
            added = [run.result(timeout=30) for run in runs]
    assert sorted(added[0] + added[1]) == ["llama3:8b", "llava:7b"]
    assert sorted(models_of(backend)) == ["llama3:8b", "llava:7b"]


@pytest.mark.django_db
def test_discovery_records_when_it_saw_a_model_load_or_unload(
    fleet: dict[str, KindMock],
) -> None:
    # As a health round does: the fleet strategy weighs this time against
    # what the proxy saw since (a request answered before an unload seen
    # later no longer makes the model hot).
    backend = fleet["ollama"].register("ollama-1")
    discover_models()
    fleet["ollama"].configure(loaded_models=["llava:7b"])
    before = timezone.now()

    discover_models()

    llama = BackendModel.objects.get(backend=backend, name="llama3:8b")
    llava = BackendModel.objects.get(backend=backend, name="llava:7b")
    assert (llama.loaded, llava.loaded) == (False, True)
    assert llama.last_loaded_at is not None and llama.last_loaded_at >= before
    assert llava.last_loaded_at is not None and llava.last_loaded_at >= before
    assert llama.vram_bytes is None and llama.expires_at is None
