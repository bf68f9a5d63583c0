"""Cached prompt tokens in the usage surfaces: rollup, API, dashboard, admin,
``nexus_usage``, prices and the configuration file."""

from __future__ import annotations

import json
from decimal import Decimal
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import Client
from rest_framework.test import APIClient

from routing.config_file import export_config, import_config_file
from routing.config_file.problems import ConfigError
from routing.models import RoutingPolicy
from tests.factories import StaffUserFactory, UsageBucketFactory, UsageRecordFactory
from usage.models import ModelPrice, TokenUsage
from usage.rollup import roll_up_usage

pytestmark = pytest.mark.django_db


def _records() -> None:
    for read, write in ((60, 10), (20, 0)):
        UsageRecordFactory(
            served_model="claude",
            prompt_tokens=100,
            total_tokens=105,
            cache_read_tokens=read,
            cache_write_tokens=write,
        )


def test_cached_tokens_roll_up_into_series_and_buckets() -> None:
    _records()
    assert roll_up_usage() == 2
    series = TokenUsage.objects.get(model="claude")
    assert (series.cache_read_tokens, series.cache_write_tokens) == (80, 10)
    report = TokenUsage.objects.report(["model"]).get()
    assert report["cached_share"] == pytest.approx(80 / 200)


def test_the_usage_api_and_command_show_cached_tokens() -> None:
    _records()
    roll_up_usage()
    api = APIClient()
    api.force_authenticate(StaffUserFactory())
    row = api.get("/api/v1/usage/tokens").json()["results"][0]
    assert (row["cache_read_tokens"], row["cache_write_tokens"]) == (80, 10)
    assert row["cached_share"] == 0.4
    out = StringIO()
    call_command("nexus_usage", "--since", "all", stdout=out)
    header, _, claude, *_ = out.getvalue().splitlines()[1:]
    assert "cached" in header and "cache-write" in header
    assert claude.split()[:6] == ["claude", "2", "0", "200", "80", "10"]


def test_the_dashboard_shows_tokens_read_from_prompt_caches(
    admin_client: Client,
) -> None:
    UsageBucketFactory(model="claude", prompt_tokens=400, cache_read_tokens=300)
    UsageBucketFactory(model="plain", prompt_tokens=50)
    page = admin_client.get("/dashboard/").content.decode()
    table = page[page.index('id="prompt-cache"') :]
    table = table[: table.index("</table>")]
    assert "claude" in table and "300" in table and "75 %" in table
    assert "plain" not in table
    history = admin_client.get("/dashboard/history?range=hour").json()
    assert sum(p["cache_read_tokens"] for p in history["points"]) == 300


def test_the_admin_lists_cache_prices_and_cached_tokens(admin_client: Client) -> None:
    ModelPrice.objects.create(
        model="claude",
        input_per_million=3,
        output_per_million=15,
        cached_input_per_million=Decimal("0.3"),
    )
    _records()
    roll_up_usage()
    prices = admin_client.get("/admin/usage/modelprice/").content.decode()
    assert "0.300" in prices
    usage = admin_client.get("/admin/usage/tokenusage/").content.decode()
    assert "column-cache_read_tokens" in usage


def test_prices_take_cached_input_and_cache_write_over_the_api() -> None:
    api = APIClient()
    api.force_authenticate(StaffUserFactory())
    body = {
        "model": "claude-*",
        "input_per_million": "3",
        "output_per_million": "15",
        "cached_input_per_million": "0.3",
        "cache_write_per_million": "3.75",
    }
    created = api.post("/api/v1/prices", body, format="json").json()
    assert created["cached_input_per_million"] == "0.300"
    price = ModelPrice.objects.get()
    assert (price.cached_input_nanos, price.cache_write_nanos) == (300, 3750)
    refused = api.post(
        "/api/v1/prices",
        {**body, "model": "x", "cached_input_per_million": "-1"},
        format="json",
    )
    assert refused.status_code == 400
    assert "cached_input_per_million" in refused.json()


def test_the_configuration_file_sets_cache_prices_and_auto_breakpoints(
    tmp_path: Path,
) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text(
        "[cache]\nanthropic_auto_breakpoints = true\n\n"
        "[prices]\n"
        '"claude-*" = { input = 3, output = 15, cached_input = 0.3, '
        "cache_write = 3.75 }\n"
        '"llama3:*" = { input = 1, output = 2 }\n',
        encoding="utf-8",
    )
    import_config_file(str(path))
    assert RoutingPolicy.load().cache_anthropic_auto_breakpoints
    claude = ModelPrice.objects.get(model="claude-*")
    assert claude.cached_input_per_million == Decimal("0.3")
    assert claude.cache_write_per_million == Decimal("3.75")
    assert ModelPrice.objects.get(model="llama3:*").cached_input_per_million is None
    exported = export_config()
    assert "[cache]\n" in exported and "anthropic_auto_breakpoints = true" in exported
    assert "cached_input = 0.3, cache_write = 3.75" in exported
    again = tmp_path / "again.toml"
    again.write_text(exported, encoding="utf-8")
    import_config_file(str(again))
    assert ModelPrice.objects.get(model="llama3:*").cache_write_per_million is None


def test_the_configuration_file_refuses_unknown_cache_keys(tmp_path: Path) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text(
        "[cache]\nauto_breakpoints = true\n\n"
        '[prices]\n"m" = { input = 1, output = 1, cached_input = "cheap" }\n',
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as refused:
        import_config_file(str(path))
    message = str(refused.value)
    assert "cache.auto_breakpoints" in message
    assert "prices.m.cached_input" in message


def test_json_usage_rows_carry_cached_tokens() -> None:
    _records()
    roll_up_usage()
    out = StringIO()
    call_command("nexus_usage", "--since", "all", "--json", stdout=out)
    [row] = json.loads(out.getvalue())["rows"]
    assert (row["cache_read_tokens"], row["cache_write_tokens"]) == (80, 10)
