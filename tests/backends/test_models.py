"""Backend and BackendModel validation: clean() rules and database constraints."""

from __future__ import annotations

import importlib
from datetime import timedelta

import pytest
from django.apps import apps as django_apps
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from backends.models import Backend, BackendKind, BackendModel, HealthStatus
from routing.core import Health
from tests.factories import BackendFactory, BackendModelFactory


def _errors(instance: Backend | BackendModel) -> dict[str, list[str]]:
    with pytest.raises(ValidationError) as caught:
        instance.full_clean()
    return caught.value.message_dict


@pytest.mark.django_db
def test_backend_names_are_unique() -> None:
    BackendFactory(name="gpu-1")

    assert "name" in _errors(Backend(name="gpu-1", base_url="http://10.0.0.9:8000"))
    with pytest.raises(IntegrityError), transaction.atomic():
        Backend.objects.create(name="gpu-1", base_url="http://10.0.0.9:8000")


@pytest.mark.django_db
def test_a_model_is_listed_once_per_backend() -> None:
    model = BackendModelFactory(name="llama3:8b")

    duplicate = BackendModel(backend=model.backend, name="llama3:8b")
    assert _errors(duplicate)
    with pytest.raises(IntegrityError), transaction.atomic():
        BackendModel.objects.create(backend=model.backend, name="llama3:8b")


@pytest.mark.django_db
def test_the_same_model_may_be_served_by_several_backends() -> None:
    BackendModelFactory(name="llama3:8b")
    other = BackendModel(backend=BackendFactory(), name="llama3:8b")

    other.full_clean()


@pytest.mark.django_db
def test_priority_cannot_be_negative() -> None:
    backend = BackendFactory()

    backend.priority = -1
    assert "priority" in _errors(backend)
    with pytest.raises(IntegrityError), transaction.atomic():
        Backend.objects.filter(pk=backend.pk).update(priority=-1)


@pytest.mark.django_db
def test_max_concurrency_zero_is_rejected_but_empty_means_no_limit() -> None:
    backend = BackendFactory(max_concurrency=None)
    backend.full_clean()

    backend.max_concurrency = 0
    assert "max_concurrency" in _errors(backend)
    with pytest.raises(IntegrityError), transaction.atomic():
        Backend.objects.filter(pk=backend.pk).update(max_concurrency=0)


@pytest.mark.django_db
def test_request_timeout_must_be_positive() -> None:
    backend = BackendFactory()

    backend.request_timeout = 0
    assert "request_timeout" in _errors(backend)
    with pytest.raises(IntegrityError), transaction.atomic():
        Backend.objects.filter(pk=backend.pk).update(request_timeout=0)


@pytest.mark.django_db
def test_unknown_kind_is_rejected() -> None:
    backend = BackendFactory()

    backend.kind = "tgi"
    assert "kind" in _errors(backend)
    with pytest.raises(IntegrityError), transaction.atomic():
        Backend.objects.filter(pk=backend.pk).update(kind="tgi")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("ftp://10.0.0.5/models", "http:// or https://"),
        ("10.0.0.5:11434", "http:// or https://"),
        ("http://user:secret@10.0.0.5:11434", "credentials"),
        ("http://10.0.0.5:11434/?token=x", "query or fragment"),
        ("http://10.0.0.5:11434/#top", "query or fragment"),
    ],
)
def test_bad_base_urls_are_rejected(url: str, expected: str) -> None:
    backend = Backend(name="gpu-1", base_url=url)

    messages = _errors(backend)["base_url"]

    assert any(expected in message for message in messages), messages


@pytest.mark.django_db
def test_credentials_in_the_url_are_not_echoed_back() -> None:
    backend = Backend(name="gpu-1", base_url="http://user:hunter2@10.0.0.5")

    assert "hunter2" not in str(_errors(backend))


@pytest.mark.django_db
def test_good_base_url_is_kept_without_trailing_slash() -> None:
    backend = Backend(name=" gpu-1 ", base_url="https://api.example.com/v1/")

    backend.full_clean()
    backend.save()

    backend.refresh_from_db()
    assert backend.name == "gpu-1"
    assert backend.base_url == "https://api.example.com/v1"


def test_repr_never_shows_the_api_key() -> None:
    backend = Backend(name="cloud", base_url="https://x.example", api_key="sk-secret")

    assert "sk-secret" not in repr(backend)
    assert "sk-secret" not in str(backend)
    assert backend.has_api_key


@pytest.mark.django_db
def test_model_name_cannot_be_blank() -> None:
    model = BackendModel(backend=BackendFactory(), name="   ")

    assert "name" in _errors(model)


@pytest.mark.django_db
def test_context_length_must_be_positive_when_given() -> None:
    model = BackendModelFactory(context_length=None)
    model.full_clean()

    model.context_length = 0
    assert "context_length" in _errors(model)
    with pytest.raises(IntegrityError), transaction.atomic():
        BackendModel.objects.filter(pk=model.pk).update(context_length=0)


@pytest.mark.django_db
def test_only_enabled_healthy_backends_are_routable() -> None:
    assert BackendFactory().is_routable
    assert not BackendFactory(unhealthy=True).is_routable
    assert not BackendFactory(disabled=True).is_routable
    assert not BackendFactory(status=HealthStatus.DRAINING).is_routable


def test_a_backend_takes_the_health_states_the_router_reads() -> None:
    field = Backend._meta.get_field("status")
    assert field.choices == [
        ("unknown", "Unknown"),
        ("healthy", "Healthy"),
        ("unhealthy", "Unhealthy"),
        ("draining", "Draining"),
    ]
    assert [value for value, _ in field.choices] == [h.value for h in Health]


@pytest.mark.django_db
def test_an_unknown_status_is_refused() -> None:
    assert "status" in _errors(BackendFactory.build(status="resting"))
    with pytest.raises(IntegrityError), transaction.atomic():
        BackendFactory(status="resting")


@pytest.mark.django_db
def test_an_operator_claims_only_the_fields_discovery_writes() -> None:
    model = BackendModelFactory(manual_fields=["supports_tools"])
    model.claim_fields(["name", "context_length", "enabled"])
    assert model.manual_fields == ["context_length", "enabled", "supports_tools"]
    model.claim_fields(["name", "loaded"])
    assert model.manual_fields == ["context_length", "enabled", "supports_tools"]


@pytest.mark.django_db
def test_a_health_result_older_than_three_intervals_is_stale(settings) -> None:
    settings.NEXUS_HEALTH_INTERVAL = 10.0
    now = timezone.now()
    backend = BackendFactory(last_check_at=now - timedelta(seconds=29))
    assert not backend.is_health_stale(now)
    assert backend.is_routable
    backend.last_check_at = now - timedelta(seconds=31)
    assert backend.is_health_stale(now)
    assert not backend.is_routable
    # Draining and unknown are not results of a check: they do not age.
    backend.status = HealthStatus.DRAINING
    assert not backend.is_health_stale(now)


@pytest.mark.django_db
def test_a_relay_workers_health_lasts_as_long_as_its_heartbeats_allow(settings) -> None:
    """Its heartbeat is its health check: with 60 s heartbeats and a 10 s
    health interval, a connected worker went stale (unroutable) 30 s after each
    ping; it now stays fresh until it would be Gone (3 missed + 1), plus the
    period at which its liveness reaches the database."""
    settings.NEXUS_HEALTH_INTERVAL = 10.0
    settings.NEXUS_RELAY_HEARTBEAT_SECONDS = 60.0
    settings.NEXUS_RELAY_SEEN_WRITE_SECONDS = 30.0
    now = timezone.now()
    worker = BackendFactory(
        kind=BackendKind.RELAY, last_check_at=now - timedelta(seconds=59)
    )
    assert not worker.is_health_stale(now)
    worker.last_check_at = now - timedelta(seconds=269)
    assert not worker.is_health_stale(now)
    worker.last_check_at = now - timedelta(seconds=271)
    assert worker.is_health_stale(now)
    # Short heartbeats written often: the health interval's 30 s still holds.
    settings.NEXUS_RELAY_HEARTBEAT_SECONDS = 2.0
    settings.NEXUS_RELAY_SEEN_WRITE_SECONDS = 1.0
    worker.last_check_at = now - timedelta(seconds=29)
    assert not worker.is_health_stale(now)
    worker.last_check_at = now - timedelta(seconds=31)
    assert worker.is_health_stale(now)
    # Other kinds keep three health intervals.
    settings.NEXUS_RELAY_HEARTBEAT_SECONDS = 60.0
    other = BackendFactory(last_check_at=now - timedelta(seconds=59))
    assert other.is_health_stale(now)


@pytest.mark.django_db
def test_upgrading_turns_unclaimed_false_capabilities_into_unknown() -> None:
    migration = importlib.import_module(
        "backends.migrations.0003_capabilities_tri_state"
    )
    backend = BackendFactory()
    defaulted = BackendModel.objects.create(
        backend=backend,
        name="generic",
        supports_vision=False,
        supports_tools=False,
        supports_json_mode=True,
    )
    claimed = BackendModel.objects.create(
        backend=backend,
        name="told-no",
        supports_tools=False,
        supports_vision=False,
        manual_fields=["supports_tools"],
    )
    migration.false_means_unknown(django_apps, None)
    defaulted.refresh_from_db()
    claimed.refresh_from_db()
    assert (
        defaulted.supports_vision,
        defaulted.supports_tools,
        defaulted.supports_json_mode,
    ) == (None, None, True)
    # An operator's own "no" stays "no".
    assert (claimed.supports_tools, claimed.supports_vision) == (False, None)
