"""A backend's api_key_env whose variable is not set: a problem or a warning.

An enabled backend needs its key (a problem, the import fails); a disabled one
serves nothing yet, so the file imports without it and says so.
"""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from backends.models import Backend
from tests.factories import BackendFactory

pytestmark = pytest.mark.django_db

EXAMPLE = Path(__file__).resolve().parents[2] / "nexus.example.toml"
CLOUD = """
[[backends]]
name = "cloud"
url = "https://api.example.com"
enabled = {enabled}
api_key_env = "NEXUS_TEST_CLOUD_KEY"
"""


def run(path: Path | str, *args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("nexus_import_config", str(path), *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("NEXUS_TEST_CLOUD_KEY", raising=False)


def test_the_example_file_checks_and_imports_without_openai_api_key() -> None:
    out, err = run(EXAMPLE, "--dry-run")
    assert "Checked" in out and not Backend.objects.exists()
    assert err.startswith(
        'Warning: backends[2] ("openai").api_key_env: environment variable '
        "OPENAI_API_KEY is not set: the backend is disabled"
    )

    run(EXAMPLE)
    openai = Backend.objects.get(name="openai")
    assert (openai.enabled, openai.api_key) == (False, "")


def test_an_enabled_backend_without_its_variable_fails_naming_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cloud.toml"
    path.write_text(CLOUD.format(enabled="true"))
    with pytest.raises(CommandError) as raised:
        run(path, "--dry-run")
    assert (
        'backends[0] ("cloud").api_key_env: environment variable '
        "NEXUS_TEST_CLOUD_KEY is not set (set it, or give the backend "
        "enabled = false to import it without a key)"
    ) in str(raised.value)
    assert not Backend.objects.exists()


def test_a_disabled_backend_keeps_its_stored_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    BackendFactory(name="cloud", api_key="stored-secret", enabled=True)
    path = tmp_path / "cloud.toml"
    path.write_text(CLOUD.format(enabled="false"))
    monkeypatch.setenv("NEXUS_TEST_CLOUD_KEY", "  ")

    out, _ = run(path, "--json")

    summary = json.loads(out)
    assert summary["ok"] is True
    (warning,) = summary["warnings"]
    assert "NEXUS_TEST_CLOUD_KEY is empty: the backend is disabled" in warning
    assert "stored-secret" not in out
    cloud = Backend.objects.get(name="cloud")
    assert (cloud.enabled, cloud.api_key) == (False, "stored-secret")
