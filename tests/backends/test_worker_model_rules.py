"""A worker is sent only the models its credential allows, and none a direct
backend serves unless the operator lets it (issue 27, item 8).

Registration, the route table, the command, the API and the admin. End to end
with real workers: tests/gateway/test_relay_allow_lists_e2e.py.
"""

from __future__ import annotations

import json
import logging
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from backends.models import BackendModel, Worker
from backends.worker_models import NOT_ALLOWED, SERVED_DIRECTLY
from backends.workers import register_worker, update_worker_models
from routing.snapshot import build_snapshot
from tests.factories import BackendFactory, BackendModelFactory, StaffUserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def api() -> APIClient:
    token = Token.objects.create(user=StaffUserFactory())
    return APIClient(HTTP_AUTHORIZATION=f"Token {token.key}")


def _direct(name: str, *models: str, **fields: object) -> None:
    backend = BackendFactory(name=name, **fields)
    for model in models:
        BackendModelFactory(backend=backend, name=model)


def _stored(worker: str) -> set[str]:
    rows = BackendModel.objects.filter(backend__name=worker, enabled=True)
    return set(rows.values_list("name", flat=True))


def _routed(worker: str) -> set[str]:
    backend = build_snapshot().backends_by_name.get(worker)
    return {m.name for m in backend.models if m.enabled} if backend else set()


def test_registration_serves_only_allowed_names_and_keeps_the_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _direct("openai", "gpt-4o")
    worker, _ = Worker.objects.create_worker("gpu-1", "llama3:*,qwen:7b,gpt-4o")
    announced = ["llama3:8b", "llama3:70b", "mistral:7b", "gpt-4o", "qwen:7b"]

    with caplog.at_level(logging.WARNING, logger="backends.workers"):
        accepted, _ = register_worker(worker.pk, "chan-1", "10.0.0.5", announced, 1)
        register_worker(worker.pk, "chan-2", "10.0.0.5", announced, 1)  # reconnect

    assert accepted.models == ("llama3:8b", "llama3:70b", "qwen:7b")
    assert (
        _stored("gpu-1") == _routed("gpu-1") == {"llama3:8b", "llama3:70b", "qwen:7b"}
    )
    assert Worker.objects.get(pk=worker.pk).refused_models == [
        {"name": "mistral:7b", "reason": NOT_ALLOWED},
        {"name": "gpt-4o", "reason": SERVED_DIRECTLY},
    ]
    # Logged when what it is refused changes, not at every reconnect.
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1
    assert "mistral:7b" in refusals[0].getMessage()


def test_a_direct_backends_name_is_refused_unless_the_worker_may_shadow() -> None:
    _direct("openai", "gpt-4o", enabled=False)  # disabled: still the operator's
    _direct("demo-alpha", "llama3:8b", is_demo=True)  # demo backends do not count
    plain, _ = Worker.objects.create_worker("gpu-1")
    trusted, _ = Worker.objects.create_worker("gpu-2", may_shadow_direct_backends=True)

    refused, _ = register_worker(plain.pk, "c1", "", ["gpt-4o", "llama3:8b"], 1)
    allowed, _ = register_worker(trusted.pk, "c2", "", ["gpt-4o", "llama3:8b"], 1)

    assert refused.models == ("llama3:8b",)
    assert allowed.models == ("gpt-4o", "llama3:8b")
    assert _routed("gpu-1") == {"llama3:8b"}
    assert _routed("gpu-2") == {"gpt-4o", "llama3:8b"}


def test_a_name_no_column_can_hold_costs_that_name_only() -> None:
    """A lone surrogate (issue 27's red team broke publishing with one) or a
    newline: refused and kept escaped, the worker's other models served."""
    worker, _ = Worker.objects.create_worker("gpu-1")
    accepted, _ = register_worker(worker.pk, "c1", "", ["ok", "\udfff", "a\nb"], 1)
    assert accepted.models == ("ok",)
    assert _stored("gpu-1") == {"ok"}
    assert [r["name"] for r in Worker.objects.get(pk=worker.pk).refused_models] == [
        "\\udfff",
        "a\\nb",
    ]


def test_a_models_update_is_sorted_the_same_way() -> None:
    worker, _ = Worker.objects.create_worker("gpu-1", "m*")
    register_worker(worker.pk, "chan-1", "", ["m1"], 1)

    update = update_worker_models(worker.pk, ["m1", "m2", "other"])

    assert update.models == ("m1", "m2")
    assert [r.name for r in update.refused] == ["other"]
    assert _stored("gpu-1") == {"m1", "m2"}
    update_worker_models(worker.pk, ["m2"])
    assert _stored("gpu-1") == {"m2"}
    assert Worker.objects.get(pk=worker.pk).refused_models == []


def test_the_route_table_applies_later_changes_before_the_worker_reregisters() -> None:
    worker, _ = Worker.objects.create_worker("gpu-1")
    register_worker(worker.pk, "chan-1", "", ["llama3:8b", "qwen:7b"], 1)
    assert _routed("gpu-1") == {"llama3:8b", "qwen:7b"}

    # A direct backend starts serving one of its names.
    _direct("vllm", "qwen:7b")
    assert _routed("gpu-1") == {"llama3:8b"}
    # The operator narrows its allow-list.
    worker.refresh_from_db()
    worker.allowed_models = "mistral:*"
    worker.save()
    assert _routed("gpu-1") == set()
    # Or lets it shadow direct backends.
    worker.allowed_models = ""
    worker.may_shadow_direct_backends = True
    worker.save()
    assert _routed("gpu-1") == {"llama3:8b", "qwen:7b"}
    # A direct backend's own models are never filtered.
    assert _routed("vllm") == {"qwen:7b"}


def test_the_command_sets_the_allow_list() -> None:
    out = StringIO()
    call_command(
        "nexus_create_worker",
        "gpu-1",
        "--models",
        "llama3:*, qwen:7b",
        "--json",
        stdout=out,
    )
    printed = json.loads(out.getvalue())
    assert printed["allowed_models"] == ["llama3:*", "qwen:7b"]
    worker = Worker.objects.get(name="gpu-1")
    assert worker.allowed_models == "llama3:*,qwen:7b"
    assert not worker.may_shadow_direct_backends

    out = StringIO()
    call_command(
        "nexus_create_worker", "gpu-2", "--may-shadow-direct-backends", stdout=out
    )
    assert Worker.objects.get(name="gpu-2").may_shadow_direct_backends
    assert "It may serve: any model" in out.getvalue()

    with pytest.raises(CommandError, match="Not a model name or glob pattern"):
        call_command(
            "nexus_create_worker", "gpu-3", "--models", "two words", stdout=out
        )
    assert not Worker.objects.filter(name="gpu-3").exists()


def test_the_api_creates_shows_and_edits_the_allow_list(api: APIClient) -> None:
    _direct("openai", "gpt-4o")
    created = api.post(
        "/api/v1/workers",
        {"name": "gpu-1", "allowed_models": "llama3:*"},
        format="json",
    )
    assert created.status_code == 201, created.json()
    assert created.json()["allowed_models"] == "llama3:*"
    assert created.json()["may_shadow_direct_backends"] is False
    pk = created.json()["id"]
    register_worker(pk, "chan-1", "10.0.0.5", ["llama3:8b", "gpt-4o"], 1)

    shown = api.get(f"/api/v1/workers/{pk}").json()
    assert shown["refused_models"] == [
        {"name": "gpt-4o", "reason": "not in the worker's allow-list"}
    ]

    edited = api.patch(
        f"/api/v1/workers/{pk}",
        {"allowed_models": "llama3:*, gpt-*", "may_shadow_direct_backends": True},
        format="json",
    )
    assert edited.status_code == 200, edited.json()
    assert edited.json()["allowed_models"] == "llama3:*,gpt-*"
    worker = Worker.objects.get(pk=pk)
    # The edit left the connection as the consumer wrote it.
    assert (worker.channel_name, worker.last_address) == ("chan-1", "10.0.0.5")
    assert _routed("gpu-1") == {"llama3:8b"}  # gpt-4o was never stored
    update_worker_models(pk, ["llama3:8b", "gpt-4o"])
    assert _routed("gpu-1") == {"llama3:8b", "gpt-4o"}


def test_the_api_refuses_bad_patterns_and_a_new_name(api: APIClient) -> None:
    worker, _ = Worker.objects.create_worker("gpu-1")
    url = f"/api/v1/workers/{worker.pk}"
    bad = api.patch(url, {"allowed_models": "ok, two words"}, format="json")
    assert bad.status_code == 400
    assert "Not a model name or glob pattern" in bad.json()["allowed_models"][0]
    renamed = api.patch(url, {"name": "gpu-2"}, format="json")
    assert renamed.status_code == 400
    assert "read-only" in renamed.json()["name"][0]
    created = api.post(
        "/api/v1/workers", {"name": "gpu-3", "allowed_models": "a b"}, format="json"
    )
    assert created.status_code == 400
    assert not Worker.objects.filter(name="gpu-3").exists()
    assert Worker.objects.get(pk=worker.pk).name == "gpu-1"


def test_the_admin_edits_the_allow_list_and_shows_the_refused(
    admin_client: Client,
) -> None:
    worker, _ = Worker.objects.create_worker("gpu-1", "llama3:*")
    register_worker(worker.pk, "chan-1", "10.0.0.5", ["llama3:8b", "<b>x</b>"], 1)
    page = admin_client.get(f"/admin/backends/worker/{worker.pk}/change/")
    assert page.status_code == 200
    assert b"&lt;b&gt;x&lt;/b&gt; (not in the worker&#x27;s allow-list)" in page.content

    response = admin_client.post(
        f"/admin/backends/worker/{worker.pk}/change/",
        {"allowed_models": "llama3:*, qwen:*", "may_shadow_direct_backends": "on"},
    )
    assert response.status_code == 302
    worker.refresh_from_db()
    assert worker.allowed_models == "llama3:*,qwen:*"
    assert worker.may_shadow_direct_backends
    assert worker.channel_name == "chan-1"
    listing = admin_client.get("/admin/backends/worker/")
    assert b"llama3:*, qwen:* (may shadow direct backends)" in listing.content
