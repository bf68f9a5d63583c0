"""A team admin manages their own team's keys and sees its usage, nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from tests.factories import StaffUserFactory, TeamFactory, TokenUsageFactory
from usage.models import ApiKey, Team

pytestmark = pytest.mark.django_db


@pytest.fixture
def teams() -> dict[str, Any]:
    ours, theirs = TeamFactory(name="ours"), TeamFactory(name="theirs")
    lead = StaffUserFactory(username="lead", role="team-admin")
    ours.admins.add(lead)
    mine, _ = ApiKey.objects.create_key("mine", team=ours)
    other, _ = ApiKey.objects.create_key("other", team=theirs)
    loose, _ = ApiKey.objects.create_key("loose")
    return {
        "ours": ours,
        "theirs": theirs,
        "lead": lead,
        "mine": mine,
        "other": other,
        "loose": loose,
    }


@pytest.fixture
def api(teams: dict[str, Any]) -> APIClient:
    client = APIClient()
    client.force_authenticate(teams["lead"])
    return client


def test_a_team_admin_lists_and_reads_only_their_teams_keys(
    api: APIClient, teams: dict[str, Any]
) -> None:
    names = [key["name"] for key in api.get("/api/v1/keys").json()["results"]]

    assert names == ["mine"]
    assert api.get(f"/api/v1/keys/{teams['other'].pk}").status_code == 404
    assert api.get(f"/api/v1/keys/{teams['loose'].pk}").status_code == 404
    assert api.get(f"/api/v1/keys/{teams['mine'].pk}/usage").status_code == 200
    assert [t["name"] for t in api.get("/api/v1/teams").json()["results"]] == ["ours"]


def test_a_team_admin_cannot_change_or_revoke_another_teams_key(
    api: APIClient, teams: dict[str, Any]
) -> None:
    other = teams["other"]

    changed = api.patch(f"/api/v1/keys/{other.pk}", {"rpm_limit": 1}, format="json")
    assert changed.status_code == 404
    assert api.post(f"/api/v1/keys/{other.pk}/revoke").status_code == 404
    # Nor move their own key into it, nor out of every team.
    mine = f"/api/v1/keys/{teams['mine'].pk}"
    moved = api.patch(mine, {"team": "theirs"}, format="json")
    assert moved.status_code == 400 and "team" in moved.json()
    freed = api.patch(mine, {"team": None}, format="json")
    assert freed.status_code == 400 and "team" in freed.json()
    other.refresh_from_db()
    assert other.is_active and other.rpm_limit is None


def test_a_team_admin_creates_keys_only_in_their_team(api: APIClient) -> None:
    outside = api.post("/api/v1/keys", {"name": "x"}, format="json")
    elsewhere = api.post("/api/v1/keys", {"name": "y", "team": "theirs"}, format="json")
    inside = api.post("/api/v1/keys", {"name": "z", "team": "ours"}, format="json")

    assert outside.status_code == 400 and "team" in outside.json()
    assert elsewhere.status_code == 400 and "team" in elsewhere.json()
    assert inside.status_code == 201 and inside.json()["key"].startswith("nx-")
    assert ApiKey.objects.get(name="z").team == Team.objects.get(name="ours")
    # Changing a team's own limits is the key-admin's.
    ours = Team.objects.get(name="ours")
    denied = api.patch(f"/api/v1/teams/{ours.pk}", {"rpm_limit": 5}, format="json")
    assert denied.status_code == 403


def test_a_team_admin_sees_only_their_teams_usage(
    api: APIClient, teams: dict[str, Any]
) -> None:
    TokenUsageFactory(api_key_prefix=teams["mine"].prefix, total_tokens=10)
    TokenUsageFactory(api_key_prefix=teams["other"].prefix, total_tokens=20)
    TokenUsageFactory(api_key_prefix=teams["loose"].prefix, total_tokens=40)

    rows = api.get("/api/v1/usage/tokens", {"by": "key"}).json()["results"]
    by_team = api.get("/api/v1/usage/tokens", {"by": "team"}).json()["results"]

    assert [(row["key"], row["total_tokens"]) for row in rows] == [
        (teams["mine"].prefix, 10)
    ]
    assert [(row["team"], row["total_tokens"]) for row in by_team] == [("ours", 10)]
    assert api.get("/api/v1/usage/stats").status_code == 403  # the whole fleet's


def test_the_admin_shows_a_team_admin_only_their_teams_keys(
    client: Client, teams: dict[str, Any]
) -> None:
    client.force_login(teams["lead"])

    listing = client.get("/admin/usage/apikey/")
    theirs = client.get(f"/admin/usage/apikey/{teams['other'].pk}/change/")
    changed = client.post(
        f"/admin/usage/apikey/{teams['other'].pk}/change/",
        {"name": "hijacked", "team": teams["ours"].pk},
    )

    assert listing.status_code == 200
    shown = [key.name for key in listing.context["cl"].result_list]
    assert shown == ["mine"]
    assert theirs.status_code == 302  # "doesn't exist", back to the index
    assert changed.status_code == 302
    assert ApiKey.objects.get(pk=teams["other"].pk).name == "other"
    form = client.get("/admin/usage/apikey/add/").context["adminform"].form
    assert list(form.fields["team"].queryset) == [teams["ours"]]
    assert form.fields["team"].required
    assert client.get("/dashboard/").status_code == 403


def test_a_key_admin_manages_every_team() -> None:
    TeamFactory(name="a"), TeamFactory(name="b")
    api = APIClient()
    api.force_authenticate(StaffUserFactory(role="key-admin"))

    created = api.post(
        "/api/v1/teams", {"name": "c", "budget_tokens": 1000}, format="json"
    )
    loose = api.post("/api/v1/keys", {"name": "no team"}, format="json")

    assert created.status_code == 201
    assert created.json()["budget_tokens"] == 1000
    assert loose.status_code == 201
    assert [t["name"] for t in api.get("/api/v1/teams").json()["results"]] == [
        "a",
        "b",
        "c",
    ]


def test_a_viewer_sees_every_teams_keys_and_changes_none(
    teams: dict[str, Any], client: Client
) -> None:
    viewer = StaffUserFactory(username="watcher", role="viewer")
    api = APIClient()
    api.force_authenticate(viewer)

    names = sorted(key["name"] for key in api.get("/api/v1/keys").json()["results"])
    teams_seen = sorted(t["name"] for t in api.get("/api/v1/teams").json()["results"])
    changed = api.patch(
        f"/api/v1/keys/{teams['mine'].pk}", {"rpm_limit": 1}, format="json"
    )
    client.force_login(viewer)
    listing = client.get("/admin/usage/apikey/")

    assert names == ["loose", "mine", "other"]
    assert teams_seen == ["ours", "theirs"]
    assert changed.status_code == 403
    assert sorted(k.name for k in listing.context["cl"].result_list) == names
