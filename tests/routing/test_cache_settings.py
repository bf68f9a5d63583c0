"""``[cache]``: the file, the admin, the API and the snapshot agree."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse

from routing.cache_purge import purge_cache
from routing.core import Policy
from routing.core.cache_policy import CachePolicy
from routing.models import RoutingPolicy
from routing.snapshot import build_snapshot
from tests.routing.test_admin import policy_form
from usage.models import ModelPrice

TOML = """
[cache]
enabled = true
ttl_seconds = 60
scope = "shared"
max_entry_bytes = 4096
only_deterministic = false

[prices]
"llama3:8b" = { input = 1, output = 2, cache_hit = 0.5 }
"""
POLICY_PAGE = reverse(
    "admin:routing_routingpolicy_change", args=(RoutingPolicy.SINGLETON_PK,)
)


def _import(tmp_path: Path, text: str) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text(text)
    call_command("nexus_import_config", str(path), stdout=StringIO())


def test_off_by_default() -> None:
    assert Policy().cache == CachePolicy(
        enabled=False,
        ttl_seconds=3600,
        scope="key",
        max_entry_bytes=1024 * 1024,
        only_deterministic=True,
    )


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"ttl_seconds": 0}, "ttl_seconds"),
        ({"scope": "team"}, "scope"),
        ({"max_entry_bytes": 0}, "max_entry_bytes"),
    ],
)
def test_out_of_range_settings_are_refused(
    values: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        CachePolicy(**values)  # type: ignore[arg-type]


@pytest.mark.django_db
def test_the_file_sets_the_policy_the_gateway_reads(tmp_path: Path) -> None:
    assert not build_snapshot().policy.cache.enabled
    _import(tmp_path, TOML)
    cache = build_snapshot().policy.cache
    assert cache == CachePolicy(True, 60, "shared", 4096, False)
    assert ModelPrice.objects.get(model="llama3:8b").cache_hit_nanos == 500
    out = StringIO()
    call_command("nexus_export_config", stdout=out)
    exported = out.getvalue()
    section = exported.split("\n[cache]\n")[1].split("\n\n")[0]
    assert "enabled = true" in section
    assert 'scope = "shared"' in section
    assert "cache_hit = 0.5" in exported
    RoutingPolicy.objects.all().delete()
    ModelPrice.objects.all().delete()
    _import(tmp_path, exported)
    assert RoutingPolicy.load().cache_policy() == cache
    assert ModelPrice.objects.get(model="llama3:8b").cache_hit_nanos == 500


@pytest.mark.django_db
def test_bad_file_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(CommandError) as caught:
        _import(tmp_path, '[cache]\nscope = "team"\nsize = 2\n')
    message = str(caught.value)
    assert "cache.size" in message
    assert "cache.scope" in message
    with pytest.raises(CommandError) as caught:
        _import(tmp_path, "[cache]\nttl_seconds = 0\n")
    assert "cache.ttl_seconds" in str(caught.value)


@pytest.mark.django_db
def test_the_policy_api_sets_them_and_refuses_bad_values() -> None:
    from rest_framework.test import APIClient

    from tests.factories import StaffUserFactory

    api = APIClient()
    api.force_authenticate(StaffUserFactory())
    wrong = api.patch("/api/v1/policy", {"cache_scope": "team"}, format="json")
    assert wrong.status_code == 400
    assert "cache_scope" in wrong.json()
    changed = api.patch(
        "/api/v1/policy",
        {"cache_enabled": True, "cache_ttl_seconds": 90},
        format="json",
    )
    assert changed.status_code == 200, changed.json()
    assert build_snapshot().policy.cache == CachePolicy(enabled=True, ttl_seconds=90)
    purged = api.post("/api/v1/cache/purge", {"model": "m"}, format="json")
    assert purged.status_code == 200
    assert purged.json()["model"] == "m"
    cache = build_snapshot().policy.cache
    assert cache.is_purged(purged.json()["at"] - 1, "m", "")
    assert not cache.is_purged(purged.json()["at"] - 1, "other", "")
    report = api.get("/api/v1/cache").json()
    assert report["settings"]["ttl_seconds"] == 90
    assert report["models"] == [] and report["keys"] == []


@pytest.mark.django_db
def test_purges_cover_what_was_stored_before_them() -> None:
    purge_cache(key_prefix="nx-a")
    first = build_snapshot().policy.cache
    at = first.purged_keys["nx-a"]
    assert first.is_purged(at - 1, "m", "nx-a")
    assert not first.is_purged(at + 1, "m", "nx-a")
    assert not first.is_purged(at - 1, "m", "nx-b")
    purge_cache()
    every = build_snapshot().policy.cache
    assert every.purged_all >= at and not every.purged_keys
    assert every.is_purged(every.purged_all - 1, "any", "")


@pytest.mark.django_db
def test_the_admin_edits_them_and_purges(admin_client: Client) -> None:
    RoutingPolicy.load()
    page = admin_client.get(POLICY_PAGE)
    assert page.status_code == 200
    assert b"Response cache" in page.content
    saved = admin_client.post(
        POLICY_PAGE, policy_form(cache_enabled="on", cache_scope="shared")
    )
    assert saved.status_code == 302
    assert build_snapshot().policy.cache == CachePolicy(enabled=True, scope="shared")
    cache_page = reverse("admin:routing_routingpolicy_cache")
    assert admin_client.get(cache_page).status_code == 200
    done = admin_client.post(cache_page, {"purge": "model", "model": "llama3:8b"})
    assert done.status_code == 302
    assert "llama3:8b" in build_snapshot().policy.cache.purged_models
    admin_client.post(cache_page, {"purge": "all"})
    assert build_snapshot().policy.cache.purged_all > 0
