"""The TOML configuration over the management API: export, import, dry run, replace."""

from __future__ import annotations

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from backends.models import Backend
from routing.models import Alias
from tests.factories import AliasFactory, BackendFactory, StaffUserFactory

pytestmark = pytest.mark.django_db

CONFIG = """
[routing]
strategy = "priority_only"
[routing.aliases]
"gpt-4" = "llama3:8b"

[[backends]]
name = "gpu-1"
url = "http://10.0.0.5:11434"
kind = "ollama"
priority = 1
[[backends.models]]
name = "llama3:8b"
context_length = 8192
"""


@pytest.fixture
def api() -> APIClient:
    token = Token.objects.create(user=StaffUserFactory())
    return APIClient(HTTP_AUTHORIZATION=f"Token {token.key}")


def _import(api: APIClient, **body: object) -> dict[str, object]:
    response = api.post("/api/v1/config/import", body, format="json")
    assert response.status_code == 200, response.content
    return dict(response.json())


def test_a_dry_run_reports_and_saves_nothing(api: APIClient) -> None:
    summary = _import(api, toml=CONFIG, dry_run=True)

    assert summary["dry_run"] is True
    assert summary["tables"]["backends"]["created"] == 1  # type: ignore[index]
    assert summary["tables"]["aliases"]["created"] == 1  # type: ignore[index]
    assert not Backend.objects.exists() and not Alias.objects.exists()


def test_import_applies_and_a_second_import_changes_nothing(api: APIClient) -> None:
    _import(api, toml=CONFIG)
    again = _import(api, toml=CONFIG)

    gpu = Backend.objects.get()
    assert (gpu.name, gpu.kind, gpu.priority) == ("gpu-1", "ollama", 1)
    assert gpu.models.get().context_length == 8192
    tables = again["tables"]
    assert isinstance(tables, dict)
    assert all(
        t["created"] == t["updated"] == t["deleted"] == 0 for t in tables.values()
    )


def test_replace_deletes_what_the_file_does_not_mention(api: APIClient) -> None:
    BackendFactory(name="old-gpu")
    BackendFactory(name="demo-alpha", is_demo=True)
    AliasFactory(name="old-alias", target="x")

    _import(api, toml=CONFIG, replace=True)

    assert sorted(Backend.objects.values_list("name", flat=True)) == [
        "demo-alpha",
        "gpu-1",
    ]
    assert list(Alias.objects.values_list("name", flat=True)) == ["gpt-4"]


def test_a_raw_toml_body_with_flags_in_the_query(api: APIClient) -> None:
    response = api.generic(
        "POST",
        "/api/v1/config/import?dry_run=true",
        CONFIG.encode(),
        content_type="application/toml",
    )

    assert response.status_code == 200, response.content
    assert response.json()["dry_run"] is True
    assert not Backend.objects.exists()


def test_every_problem_is_listed_and_nothing_changes(api: APIClient) -> None:
    bad = CONFIG.replace("context_length = 8192", 'context_length = "big"').replace(
        'kind = "ollama"', 'kind = "gopher"'
    )

    response = api.post("/api/v1/config/import", {"toml": bad}, format="json")

    assert response.status_code == 400
    body = response.json()
    assert body["detail"] == "2 problems in the configuration; nothing was changed."
    assert any("context_length" in problem for problem in body["problems"])
    assert any("gopher" in problem for problem in body["problems"])
    assert not Backend.objects.exists()


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (b"[routing\n", "application/toml", "invalid TOML at line"),
        (b"\xff\xfe", "application/toml", "not UTF-8"),
        (b'{"toml": ["x"]}', "application/json", "Not a valid string"),
        (b'{"dry_run": true}', "application/json", "This field is required"),
    ],
)
def test_bad_bodies_get_a_400_that_says_why(
    api: APIClient, body: bytes, content_type: str, message: str
) -> None:
    response = api.generic(
        "POST", "/api/v1/config/import", body, content_type=content_type
    )

    assert response.status_code == 400
    assert message in response.content.decode()


def test_the_api_does_not_read_the_servers_environment(
    api: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU1_KEY", "sk-from-the-server-environment")
    config = CONFIG.replace("priority = 1", 'priority = 1\napi_key_env = "GPU1_KEY"')

    response = api.post("/api/v1/config/import", {"toml": config}, format="json")

    assert not Backend.objects.filter(api_key="sk-from-the-server-environment").exists()
    assert "sk-from-the-server-environment" not in response.content.decode()


def test_export_is_toml_that_imports_back_unchanged(api: APIClient) -> None:
    _import(api, toml=CONFIG)
    BackendFactory(name="with-key", api_key="sk-never-exported")

    response = api.get("/api/v1/config/export")

    assert response.status_code == 200
    assert response["Content-Type"] == "application/toml; charset=utf-8"
    text = response.content.decode()
    assert 'name = "gpu-1"' in text and "sk-never-exported" not in text
    tables = _import(api, toml=text, replace=True)["tables"]
    assert isinstance(tables, dict)
    assert all(
        t["created"] == t["updated"] == t["deleted"] == 0 for t in tables.values()
    )
