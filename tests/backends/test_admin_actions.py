"""Admin health actions and badges, and the admin's record of fields set by hand."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.messages import constants
from django.test import Client
from django.urls import reverse

from backends.discovery import discover_models
from backends.models import Backend, BackendModel, HealthStatus
from routing.versioning import read_config_version
from tests.backends.mock_fleet import KindMock, closed_port_url, running_mocks
from tests.factories import BackendFactory, BackendModelFactory

CHANGELIST = reverse("admin:backends_backend_changelist")
MODELS_CHANGELIST = reverse("admin:backends_backendmodel_changelist")


@pytest.fixture(scope="module")
def ollama() -> Iterator[KindMock]:
    with running_mocks(
        ("ollama", "--models", "llama3:8b,llava:7b", "--vision-models", "llava:7b")
    ) as (mock,):
        yield mock


def act(
    client: Client, action: str, backends: list[Backend], url: str = CHANGELIST
) -> list[tuple[int, str]]:
    """Run an admin action; return the (level, text) of each message shown."""
    response = client.post(
        url,
        {"action": action, "_selected_action": [b.pk for b in backends]},
        follow=True,
    )
    assert response.status_code == 200
    return [(m.level, m.message) for m in response.context["messages"]]


@pytest.mark.django_db
def test_check_health_now_reports_each_backend(
    admin_client: Client, ollama: KindMock
) -> None:
    up = ollama.register("gpu-up", priority=1)
    down = BackendFactory(name="gpu-down", base_url=closed_port_url(), priority=2)
    messages = act(admin_client, "check_health_now", [up, down])
    assert len(messages) == 2
    level, text = messages[0]
    assert level == constants.SUCCESS
    assert text.startswith("gpu-up: healthy (was unknown), ")
    assert text.endswith(" ms, 0 models")
    assert messages[1] == (
        constants.WARNING,
        "gpu-down: healthy, 0 models — connection refused",
    )
    down.refresh_from_db()
    assert down.consecutive_failures == 1


@pytest.mark.django_db
def test_discover_models_reports_each_backend(
    admin_client: Client, ollama: KindMock
) -> None:
    backend = ollama.register("gpu-1")
    dead = BackendFactory(name="gpu-2", base_url=closed_port_url())
    messages = act(admin_client, "discover_models_now", [backend, dead])
    assert messages == [
        (constants.SUCCESS, "gpu-1: 2 models; added llama3:8b, llava:7b"),
        (constants.WARNING, "gpu-2: not listed: connection refused"),
    ]
    assert backend.models.count() == 2


@pytest.mark.django_db(transaction=True)
def test_drain_stops_new_traffic_and_undrain_checks_before_trusting(
    admin_client: Client,
) -> None:
    # Transactional tests run last, after the module's mock is gone: a new one.
    with running_mocks(("vllm", "--models", "m")) as (mock,):
        backend = mock.register("gpu-1", status=HealthStatus.HEALTHY)
        check_drain_and_undrain(admin_client, backend)


def check_drain_and_undrain(admin_client: Client, backend: Backend) -> None:
    before = read_config_version()
    messages = act(admin_client, "drain", [backend])
    assert messages == [
        (constants.SUCCESS, "gpu-1: draining; it gets no new requests.")
    ]
    backend.refresh_from_db()
    assert backend.status == HealthStatus.DRAINING
    assert read_config_version() == before + 1
    assert act(admin_client, "drain", [backend]) == [
        (constants.INFO, "gpu-1: was already draining.")
    ]

    ((level, text),) = act(admin_client, "undrain", [backend])
    assert level == constants.SUCCESS
    assert text.startswith("gpu-1: undrained; gpu-1: healthy (was unknown), ")
    backend.refresh_from_db()
    assert backend.status == HealthStatus.HEALTHY
    assert act(admin_client, "undrain", [backend]) == [
        (constants.INFO, "gpu-1: was not draining.")
    ]


@pytest.mark.django_db
def test_undrain_of_a_dead_backend_leaves_it_out_of_traffic(
    admin_client: Client,
) -> None:
    backend = BackendFactory(base_url=closed_port_url(), status=HealthStatus.DRAINING)
    ((level, text),) = act(admin_client, "undrain", [backend])
    assert level == constants.WARNING
    assert text.endswith("unknown, 0 models — connection refused")
    backend.refresh_from_db()
    assert backend.status == HealthStatus.UNKNOWN


@pytest.mark.django_db
def test_the_status_badge_shows_the_last_error_on_hover(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    BackendFactory(name="gpu-1", unhealthy=True, last_error='HTTP 502 from "GET /x"')
    with django_assert_max_num_queries(12):
        html = admin_client.get(CHANGELIST).content.decode()
    assert (
        'title="HTTP 502 from &quot;GET /x&quot; (3 failed check(s) in a row)"' in html
    )


def _select(value: bool | None) -> str:
    return {True: "true", False: "false", None: "unknown"}[value]


def model_form(row: BackendModel, **changes: Any) -> dict[str, Any]:
    data = {
        "backend": row.backend_id,
        "name": row.name,
        "context_length": row.context_length or "",
        # The admin's yes / no / unknown select.
        "supports_vision": _select(row.supports_vision),
        "supports_tools": _select(row.supports_tools),
        "supports_json_mode": _select(row.supports_json_mode),
        # What discovery filled for the fleet strategy, as the form shows it.
        "size_bytes": row.size_bytes or "",
        "parameters_b": row.parameters_b or "",
        "kv_bytes_per_token": row.kv_bytes_per_token or "",
        "max_concurrency": row.max_concurrency or "",
        "loaded": "on" if row.loaded else "",
        "enabled": "on" if row.enabled else "",
    } | changes
    return {key: value for key, value in data.items() if value != ""}


@pytest.mark.django_db
def test_an_edit_in_the_admin_is_kept_by_discovery(
    admin_client: Client, ollama: KindMock
) -> None:
    backend = ollama.register("gpu-1")
    discover_models()
    row = BackendModel.objects.get(backend=backend, name="llava:7b")
    url = reverse("admin:backends_backendmodel_change", args=(row.pk,))
    response = admin_client.post(
        url,
        model_form(row, context_length="2048", supports_vision="false"),
        follow=True,
    )
    assert response.status_code == 200
    row.refresh_from_db()
    assert row.manual_fields == ["context_length", "supports_vision"]
    discover_models()
    row.refresh_from_db()
    assert (row.context_length, row.supports_vision) == (2048, False)

    messages = act(admin_client, "let_discovery_manage", [row], MODELS_CHANGELIST)
    assert "1 model(s)" in messages[0][1]
    discover_models()
    row.refresh_from_db()
    assert (row.context_length, row.supports_vision, row.manual_fields) == (
        8192,
        True,
        [],
    )


@pytest.mark.django_db
def test_an_edit_in_the_backend_pages_inline_is_recorded_too(
    admin_client: Client,
) -> None:
    backend = BackendFactory(name="gpu-1", base_url="http://10.0.0.5:11434")
    row = BackendModelFactory(backend=backend, name="m", context_length=8192)
    untouched = BackendModelFactory(backend=backend, name="n", context_length=8192)
    data = {
        "name": backend.name,
        "base_url": backend.base_url,
        "kind": backend.kind,
        "enabled": "on",
        "priority": "10",
        "request_timeout": "300",
        "models-TOTAL_FORMS": "2",
        "models-INITIAL_FORMS": "2",
        "models-MIN_NUM_FORMS": "0",
        "models-MAX_NUM_FORMS": "1000",
    }
    for index, model in enumerate((row, untouched)):
        data |= {
            f"models-{index}-id": str(model.pk),
            f"models-{index}-backend": str(backend.pk),
            f"models-{index}-name": model.name,
            f"models-{index}-context_length": "8192",
            f"models-{index}-enabled": "on",
        }
    data["models-0-supports_tools"] = "true"
    url = reverse("admin:backends_backend_change", args=(backend.pk,))
    response = admin_client.post(url, data)
    assert response.status_code == 302, response.content.decode()[-2000:]
    row.refresh_from_db()
    untouched.refresh_from_db()
    assert (row.supports_tools, row.manual_fields) == (True, ["supports_tools"])
    assert untouched.manual_fields == []
