"""Teams from the command line and in configuration files."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from routing.config_file import export_config, import_config, read_config
from routing.config_file.problems import ConfigError
from tests.factories import TeamFactory, TokenUsageFactory
from usage.models import ApiKey, Team

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_a_team_is_created_with_its_pool_and_keys_join_it() -> None:
    created = json.loads(
        run(
            "nexus_create_team",
            "research",
            "--budget-tokens",
            "1000000",
            "--budget-usd",
            "25.5",
            "--period",
            "day",
            "--rpm",
            "600",
            "--json",
        )
    )
    key = json.loads(run("nexus_create_key", "alice", "--team", "research", "--json"))

    team = Team.objects.get(pk=created["id"])
    assert (team.budget_tokens, str(team.budget_usd), team.budget_period) == (
        1_000_000,
        "25.5000",
        "day",
    )
    assert team.rpm_limit == 600
    assert ApiKey.objects.get(prefix=key["prefix"]).team == team


def test_bad_team_commands_fail_with_a_message() -> None:
    TeamFactory(name="taken")
    with pytest.raises(CommandError, match="exists"):
        run("nexus_create_team", "taken")
    with pytest.raises(CommandError, match="no team is named 'nope'"):
        run("nexus_create_key", "bob", "--team", "nope")
    with pytest.raises(CommandError, match="--budget-usd"):
        run("nexus_create_team", "x", "--budget-usd", "lots")
    with pytest.raises(CommandError, match="Cannot create the team"):
        run("nexus_create_team", "y", "--rpm", "0")


def test_usage_by_team_sums_the_keys_of_each_team() -> None:
    team = TeamFactory(name="research")
    one, _ = ApiKey.objects.create_key("one", team=team)
    two, _ = ApiKey.objects.create_key("two", team=team)
    loose, _ = ApiKey.objects.create_key("loose")
    for key, tokens in ((one, 10), (two, 20), (loose, 5)):
        TokenUsageFactory(api_key_prefix=key.prefix, total_tokens=tokens)

    rows = json.loads(run("nexus_usage", "--by", "team", "--since", "all", "--json"))
    table = run("nexus_usage", "--by", "team", "--since", "all")

    assert [(r["team"], r["total_tokens"]) for r in rows["rows"]] == [
        ("research", 30),
        (None, 5),
    ]
    assert "research" in table and "(no team)" in table


def test_teams_round_trip_through_a_configuration_file() -> None:
    ApiKey.objects.create_key("alice")
    source = """
[[teams]]
name = "research"
budget_period = "day"
budget_tokens = 5000
budget_usd = 12.5
rpm = 100

[[keys]]
name = "alice"
team = "research"
rpm = 10
"""
    summary = import_config(read_config(source, "t.toml", environ={}), source="t")

    team = Team.objects.get(name="research")
    assert summary.teams.created == 1
    assert (team.budget_tokens, team.rpm_limit, str(team.budget_usd)) == (
        5000,
        100,
        "12.5000",
    )
    assert ApiKey.objects.get(name="alice").team == team
    exported = export_config()
    assert '[[teams]]\nname = "research"' in exported
    assert 'team = "research"' in exported
    again = import_config(read_config(exported, "e.toml", environ={}), source="e")
    assert again.teams.unchanged == 1 and again.client_keys.unchanged == 1


def test_a_key_naming_an_unknown_team_is_a_problem_and_nothing_changes() -> None:
    ApiKey.objects.create_key("alice")
    source = '[[keys]]\nname = "alice"\nteam = "ghosts"\n'

    with pytest.raises(ConfigError) as error:
        import_config(read_config(source, "t.toml", environ={}), source="t")

    assert any("keys[0]" in p and "ghosts" in p for p in error.value.problems)
    assert ApiKey.objects.get(name="alice").team is None
