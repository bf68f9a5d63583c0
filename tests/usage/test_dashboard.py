"""The staff dashboard page and its history endpoint."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.contrib.staticfiles import finders
from django.test import Client
from django.utils import timezone

from tests.factories import UsageBucketFactory
from usage.models import ApiKey, KeySpend

pytestmark = pytest.mark.django_db


def test_dashboard_sends_anonymous_visitors_to_the_admin_login(client: Client) -> None:
    response = client.get("/dashboard/")
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/?next=/dashboard/")


def test_dashboard_sends_non_staff_users_to_the_admin_login(client: Client) -> None:
    client.force_login(User.objects.create_user("visitor"))
    response = client.get("/dashboard/")
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_dashboard_page_loads_its_script_and_stream(admin_client: Client) -> None:
    response = admin_client.get("/dashboard/")
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-stream-url="/api/usage-stream"' in page
    assert 'data-history-url="/dashboard/history"' in page
    assert "usage/dashboard.js" in page
    assert "usage/dashboard.css" in page
    assert 'id="backends"' in page


def test_history_sums_last_hour_per_minute(admin_client: Client) -> None:
    minute = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    UsageBucketFactory(
        minute=minute,
        model="llama3:8b",
        requests=3,
        errors=1,
        total_tokens=30,
        latency_ms_sum=300.0,
    )
    UsageBucketFactory(
        minute=minute,
        backend="gpu-2",
        model="llama3:8b",
        requests=1,
        total_tokens=10,
        latency_ms_sum=500.0,
    )
    UsageBucketFactory(minute=minute - timedelta(hours=2), model="old", requests=7)

    history = admin_client.get("/dashboard/history?range=hour").json()

    assert history["range"] == "hour"
    assert history["step_seconds"] == 60
    assert len(history["points"]) == 60
    busy = [p for p in history["points"] if p["requests"]]
    assert busy == [
        {
            "start": minute.isoformat(),
            "requests": 4,
            "errors": 1,
            "total_tokens": 40,
            "cache_read_tokens": 0,
            "latency_ms_avg": 200.0,
        }
    ]
    assert history["tokens_by_model"] == {"llama3:8b": 40}


def test_history_of_the_day_groups_quarter_hours(admin_client: Client) -> None:
    now = timezone.now().replace(second=0, microsecond=0)
    UsageBucketFactory(minute=now - timedelta(hours=2), model="a", requests=2)
    UsageBucketFactory(minute=now - timedelta(hours=30), model="b", requests=9)

    history = admin_client.get("/dashboard/history?range=day").json()

    assert history["step_seconds"] == 900
    assert len(history["points"]) == 96
    assert sum(p["requests"] for p in history["points"]) == 2
    assert history["tokens_by_model"] == {"a": 14}


def test_history_explains_an_unknown_range(admin_client: Client) -> None:
    response = admin_client.get("/dashboard/history?range=week")
    assert response.status_code == 400
    assert response.json()["detail"] == ("Unknown range 'week'; use one of: hour, day.")


def test_history_is_for_staff_only(client: Client) -> None:
    response = client.get("/dashboard/history")
    assert response.status_code == 403
    assert "staff" in response.json()["detail"]


def test_the_charting_library_is_served_by_nexus_not_a_cdn(
    admin_client: Client,
) -> None:
    page = admin_client.get("/dashboard/").content.decode()

    assert "/static/vendor/plotly/plotly.min.js" in page
    assert "https://" not in page and "cdn" not in page.lower()
    script = finders.find("vendor/plotly/plotly.min.js")
    assert script is not None
    with open(script, "rb") as bundle:
        assert b"plotly.js" in bundle.read(200)
    # Only that file of the plotly package is published as a static file.
    assert finders.find("vendor/plotly/widgetbundle.js") is None


def test_dashboard_shows_spend_per_key_this_month(
    admin_client: Client, django_assert_max_num_queries
) -> None:
    today = timezone.now().date()
    cheap, _ = ApiKey.objects.create_key("cheap-team")
    dear, _ = ApiKey.objects.create_key(
        "dear-team", budget_usd="50", budget_period="month"
    )
    for key, nanos in ((cheap, 1_000_000), (dear, 2_500_000_000)):
        KeySpend.objects.create(
            api_key_prefix=key.prefix,
            day=today,
            requests=3,
            total_tokens=1234,
            cost_nanos=nanos,
        )
    # Last month's spend is not in this month's table.
    KeySpend.objects.create(
        api_key_prefix=cheap.prefix,
        day=today.replace(day=1) - timedelta(days=1),
        requests=1,
        total_tokens=1,
        cost_nanos=10**12,
    )

    # 8; 2 for the batches section (running batches, the day's batch tokens);
    # 1 for the spend per team.
    with django_assert_max_num_queries(11):
        page = admin_client.get("/dashboard/").content.decode()

    table = page[page.index('id="spend"') :]
    table = table[: table.index("</table>")]
    # Most cost first, with the budget beside it.
    assert table.index("dear-team") < table.index("cheap-team")
    assert "2.5000" in table and "0.0010" in table
    assert "$50.0000 per UTC month" in table
    assert "1000.0000" not in table


def test_dashboard_shows_the_cache_hit_rate_and_tokens_saved(
    admin_client: Client,
) -> None:
    UsageBucketFactory(
        minute=timezone.now() - timedelta(minutes=3),
        model="llama3:8b",
        requests=4,
        total_tokens=400,
        cache_hits=3,
        cache_saved_tokens=300,
    )
    page = admin_client.get("/dashboard/").content.decode()
    section = page[page.index('id="cache"') :]
    section = section[: section.index("</table>")]
    assert "llama3:8b" in section and "75 %" in section and "300" in section
    assert "3 of 4 requests answered from the cache (75 %), 300 tokens saved" in page


def test_the_dashboard_shows_spend_per_team(admin_client: Client) -> None:
    from datetime import UTC, datetime

    from tests.factories import TeamFactory
    from usage.models import ApiKey, KeySpend

    team = TeamFactory(name="research", budget_tokens=5000)
    one, _ = ApiKey.objects.create_key("one", team=team)
    two, _ = ApiKey.objects.create_key("two", team=team)
    today = datetime.now(UTC).date()
    for key, tokens in ((one, 100), (two, 250)):
        KeySpend.objects.create(
            api_key_prefix=key.prefix, day=today, requests=1, total_tokens=tokens
        )

    page = admin_client.get("/dashboard/").content.decode()

    table = page[page.index('id="team-spend"') :]
    table = table[: table.index("</table>")]
    assert "research" in table and ">350<" in table and "5000 tokens" in table
