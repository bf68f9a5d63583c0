"""Input PostgreSQL cannot store (NUL) is refused with a clear message (item 19).

The TOML import's own check is in test_config_file.py; the usage side (a
request whose model name holds NUL is still counted) in tests/usage.
"""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from backends.models import BackendModel
from routing.models import Alias
from tests.factories import BackendFactory, StaffUserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(StaffUserFactory())
    return client


def test_the_api_refuses_a_nul_in_a_name_with_a_400(api: APIClient) -> None:
    alias = api.post(
        "/api/v1/aliases", {"name": "gpt\x00-4", "target": "m"}, format="json"
    )
    assert alias.status_code == 400
    assert "Null characters are not allowed." in str(alias.json())
    backend = BackendFactory()
    model = api.post(
        "/api/v1/backend-models",
        {"backend": backend.pk, "name": "llama\x00"},
        format="json",
    )
    assert model.status_code == 400
    assert not Alias.objects.exists() and not BackendModel.objects.exists()


def test_the_admin_refuses_a_nul_in_a_name_on_the_form(admin_client: Client) -> None:
    response = admin_client.post(
        reverse("admin:routing_alias_add"), {"name": "gpt-4", "target": "x\x00y"}
    )
    assert response.status_code == 200  # the form again, with the error
    assert "Null characters are not allowed." in response.content.decode()
    assert not Alias.objects.exists()
