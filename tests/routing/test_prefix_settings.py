"""``[routing.prefix]`` and a backend's prefix_cache_tokens: the file, the
admin, the API and the snapshot agree, and bad values are named."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from routing.core.prefix_policy import PrefixPolicy
from routing.models import RoutingPolicy
from routing.snapshot import build_snapshot
from tests.factories import StaffUserFactory
from tests.routing.test_admin import policy_form

TOML = """
[routing.prefix]
enabled = true
block_chars = 128
max_imbalance = 3
max_imbalance_ratio = 0.25
cache_blocks = 2000
session_keys = "x-conversation,user"
session_ttl_seconds = 90

[[backends]]
name = "gpu-1"
url = "http://gpu-1.lan:8000"
kind = "vllm"
prefix_cache_tokens = 500000
"""
POLICY_PAGE = reverse(
    "admin:routing_routingpolicy_change", args=(RoutingPolicy.SINGLETON_PK,)
)


def _import(tmp_path: Path, text: str) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text(text)
    call_command("nexus_import_config", str(path), stdout=StringIO())


@pytest.mark.django_db
def test_off_by_default_and_the_file_sets_what_the_gateway_reads(
    tmp_path: Path,
) -> None:
    assert build_snapshot().policy.prefix == PrefixPolicy()
    assert not PrefixPolicy().enabled
    _import(tmp_path, TOML)
    snap = build_snapshot()
    assert snap.policy.prefix == PrefixPolicy(
        enabled=True,
        block_chars=128,
        max_imbalance=3,
        max_imbalance_ratio=0.25,
        cache_blocks=2000,
        session_keys="x-conversation,user",
        session_ttl_seconds=90.0,
    )
    assert snap.backends_by_name["gpu-1"].prefix_cache_tokens == 500_000
    out = StringIO()
    call_command("nexus_export_config", stdout=out)
    exported = out.getvalue()
    assert "enabled = true" in exported.split("[routing.prefix]")[1]
    assert "prefix_cache_tokens = 500000" in exported
    RoutingPolicy.objects.all().delete()
    _import(tmp_path, exported)
    assert RoutingPolicy.load().prefix_policy() == snap.policy.prefix


@pytest.mark.django_db
def test_bad_file_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(CommandError) as caught:
        _import(tmp_path, "[routing.prefix]\nblock_chars = 4\nblocks = 2\n")
    message = str(caught.value)
    assert "routing.prefix.blocks" in message
    assert "routing.prefix.block_chars" in message
    with pytest.raises(CommandError) as caught:
        _import(tmp_path, '[routing.prefix]\nsession_keys = "x-a b"\n')
    assert "routing.prefix.session_keys" in str(caught.value)


@pytest.mark.django_db
def test_the_policy_api_sets_them_and_refuses_bad_values() -> None:
    api = APIClient()
    api.force_authenticate(StaffUserFactory())
    current = api.get("/api/v1/policy").json()
    assert current["prefix_enabled"] is False
    assert current["prefix_block_chars"] == 256
    wrong = api.patch(
        "/api/v1/policy",
        {"prefix_block_chars": 8, "prefix_session_ttl_seconds": 0},
        format="json",
    )
    assert wrong.status_code == 400
    assert set(wrong.json()) >= {"prefix_block_chars", "prefix_session_ttl_seconds"}
    changed = api.patch(
        "/api/v1/policy",
        {"prefix_enabled": True, "prefix_max_imbalance": 5},
        format="json",
    )
    assert changed.status_code == 200, changed.json()
    assert build_snapshot().policy.prefix == PrefixPolicy(enabled=True, max_imbalance=5)


@pytest.mark.django_db
def test_the_admin_edits_them_on_the_policy_page(admin_client: Client) -> None:
    RoutingPolicy.load()
    page = admin_client.get(POLICY_PAGE)
    assert b"Prefix-aware routing" in page.content
    refused = admin_client.post(
        POLICY_PAGE, policy_form(prefix_session_keys="not a key!")
    )
    assert refused.status_code == 200
    assert b"The session keys must be comma-separated" in refused.content
    saved = admin_client.post(
        POLICY_PAGE, policy_form(prefix_enabled="on", prefix_cache_blocks="100")
    )
    assert saved.status_code == 302
    assert build_snapshot().policy.prefix == PrefixPolicy(
        enabled=True, cache_blocks=100
    )


@pytest.mark.django_db
def test_nexus_route_explain_names_the_prefix_signal_when_on() -> None:
    from backends.models import Backend, BackendModel, HealthStatus

    backend = Backend.objects.create(
        name="gpu-1", base_url="http://gpu-1.lan:8000", status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name="m")
    out = StringIO()
    call_command("nexus_route", "m", "--explain", stdout=out)
    assert "prefix routing" not in out.getvalue()  # off: nothing about it
    policy = RoutingPolicy.load()
    policy.prefix_enabled = True
    policy.save()
    out = StringIO()
    call_command("nexus_route", "m", "--explain", "--prompt", "x" * 600, stdout=out)
    assert "prefix routing: strategy, 0 of 3 prompt blocks held" in out.getvalue()
