"""``[routing.context_shift]``: the file, the policy row and the snapshot agree."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from routing.core import Policy
from routing.core.context_shift_policy import ContextShiftPolicy
from routing.models import RoutingPolicy
from routing.snapshot import build_snapshot

TOML = """
[routing.context_shift]
enabled = false
keep_last_messages = 4
max_retries = 1
"""


def _import(tmp_path: Path, text: str) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text(text)
    call_command("nexus_import_config", str(path), stdout=StringIO())


def test_on_by_default_with_two_retries() -> None:
    assert Policy().context_shift == ContextShiftPolicy(True, 1, 2)


@pytest.mark.django_db
def test_the_file_sets_the_policy_the_gateway_reads(tmp_path: Path) -> None:
    assert build_snapshot().policy.context_shift.enabled is True
    _import(tmp_path, TOML)
    assert build_snapshot().policy.context_shift == ContextShiftPolicy(
        enabled=False, keep_last_messages=4, max_retries=1
    )
    out = StringIO()
    call_command("nexus_export_config", stdout=out)
    exported = out.getvalue()
    assert "[routing.context_shift]\n" in exported
    assert "enabled = false" in exported.split("[routing.context_shift]")[1]
    RoutingPolicy.objects.all().delete()
    _import(tmp_path, exported)
    assert RoutingPolicy.load().context_shift_policy().keep_last_messages == 4


@pytest.mark.django_db
def test_out_of_range_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(CommandError) as caught:
        _import(tmp_path, "[routing.context_shift]\nmax_retries = 9\nkeep_last = 2\n")
    message = str(caught.value)
    assert "routing.context_shift.keep_last" in message


@pytest.mark.django_db
def test_the_policy_api_sets_them_and_refuses_out_of_range_values() -> None:
    from rest_framework.test import APIClient

    from tests.factories import StaffUserFactory

    api = APIClient()
    api.force_authenticate(StaffUserFactory())
    wrong = api.patch("/api/v1/policy", {"context_shift_max_retries": 9}, format="json")
    assert wrong.status_code == 400
    assert "context_shift_max_retries" in wrong.json()
    changed = api.patch(
        "/api/v1/policy",
        {"context_shift_enabled": False, "context_shift_keep_last_messages": 3},
        format="json",
    )
    assert changed.status_code == 200, changed.json()
    assert build_snapshot().policy.context_shift == ContextShiftPolicy(
        enabled=False, keep_last_messages=3, max_retries=2
    )
