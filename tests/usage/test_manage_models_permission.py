"""The can_manage_models permission of client keys, everywhere a key is set.

Off by default; granted with ``nexus_create_key --manage-models``, the
admin's key form, the REST API's keys, and ``manage_models = true`` in a
config file's ``[[keys]]`` (exported back the same way); the gateway's
snapshot carries it onto the key's policy, which model management checks
(tests/gateway/test_model_management.py).
"""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from routing.snapshot import build_state
from tests.factories import StaffUserFactory
from usage.models import ApiKey

pytestmark = pytest.mark.django_db


def _create_key(*args: str) -> ApiKey:
    out = StringIO()
    call_command("nexus_create_key", *args, "--json", stdout=out)
    return ApiKey.objects.get(prefix=json.loads(out.getvalue())["prefix"])


def test_the_command_grants_it_only_when_asked() -> None:
    app = _create_key("app")
    assert not app.can_manage_models
    ops = _create_key("ops", "--manage-models")
    assert ops.can_manage_models
    policies = build_state().policies
    assert policies[ops.prefix].can_manage_models
    assert not policies[app.prefix].can_manage_models


def test_the_api_creates_and_changes_it() -> None:
    token = Token.objects.create(user=StaffUserFactory())
    api = APIClient(HTTP_AUTHORIZATION=f"Token {token.key}")
    created = api.post("/api/v1/keys", {"name": "ops"}, format="json").json()
    assert created["can_manage_models"] is False
    changed = api.patch(
        f"/api/v1/keys/{created['id']}", {"can_manage_models": True}, format="json"
    )
    assert changed.status_code == 200 and changed.json()["can_manage_models"] is True
    assert ApiKey.objects.get(pk=created["id"]).can_manage_models
    bad = api.patch(
        f"/api/v1/keys/{created['id']}", {"can_manage_models": "maybe"}, format="json"
    )
    assert bad.status_code == 400 and "can_manage_models" in bad.json()


def test_the_admin_add_form_grants_it(admin_client: Client) -> None:
    add = reverse("admin:usage_apikey_add")
    assert "can_manage_models" in admin_client.get(add).context["adminform"].form.fields
    admin_client.post(
        add, {"name": "ops", "budget_period": "month", "can_manage_models": "on"}
    )
    assert ApiKey.objects.get(name="ops").can_manage_models


def test_the_config_file_sets_and_exports_it(tmp_path: Path) -> None:
    key, _ = ApiKey.objects.create_key("ops")
    path = tmp_path / "nexus.toml"
    path.write_text('[[keys]]\nname = "ops"\nmanage_models = true\n')
    call_command("nexus_import_config", str(path), stdout=StringIO())
    key.refresh_from_db()
    assert key.can_manage_models
    out = StringIO()
    call_command("nexus_export_config", stdout=out)
    assert "manage_models = true" in out.getvalue()
    path.write_text('[[keys]]\nname = "ops"\nmanage_models = "yes"\n')
    with pytest.raises(Exception, match="manage_models"):
        call_command("nexus_import_config", str(path), stdout=StringIO())
