"""`manage.py nexus_create_key`: prints a new client key once."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from usage.models import ApiKey


def _run(*args: str) -> str:
    out = StringIO()
    call_command("nexus_create_key", *args, stdout=out)
    return out.getvalue()


def _stored_values() -> str:
    return " ".join(
        str(value) for row in ApiKey.objects.values() for value in row.values()
    )


@pytest.mark.django_db
def test_prints_a_key_that_resolves_and_is_not_stored() -> None:
    output = _run("ci-pipeline")

    raw = next(line for line in output.splitlines() if line.startswith("nx-"))
    key = ApiKey.objects.for_raw_key(raw)
    assert key is not None and key.name == "ci-pipeline"
    assert "will not be shown again" in output
    assert raw not in _stored_values()


@pytest.mark.django_db
def test_json_output_for_scripts() -> None:
    payload = json.loads(_run("ci-pipeline", "--json"))

    key = ApiKey.objects.for_raw_key(payload["key"])
    assert key is not None
    assert payload == {
        "name": "ci-pipeline",
        "prefix": key.prefix,
        "key": payload["key"],
    }
    assert payload["key"] not in _stored_values()


@pytest.mark.django_db
def test_each_run_creates_a_new_key() -> None:
    first = json.loads(_run("team-a", "--json"))["key"]
    second = json.loads(_run("team-a", "--json"))["key"]

    assert first != second
    assert ApiKey.objects.filter(name="team-a").count() == 2


@pytest.mark.django_db
def test_blank_name_is_refused_clearly() -> None:
    with pytest.raises(CommandError, match="name"):
        _run("   ")

    assert not ApiKey.objects.exists()
