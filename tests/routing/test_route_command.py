from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from routing.models import Alias, RoutingPolicy
from tests.factories import BackendFactory, BackendModelFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet() -> None:
    text = BackendFactory(name="gpu-text", priority=1)
    BackendModelFactory(backend=text, name="llama3:8b", supports_tools=False)
    tools = BackendFactory(name="gpu-tools", priority=2)
    BackendModelFactory(backend=tools, name="llama3:8b", supports_tools=True)
    BackendFactory(name="gpu-down", unhealthy=True)
    BackendModelFactory(
        backend=BackendFactory(name="gpu-off", unhealthy=True), name="llama3:8b"
    )
    Alias.objects.create(name="gpt-4", target="llama3:8b")


def test_prints_the_chosen_backend(fleet: None, capsys) -> None:
    call_command("nexus_route", "llama3:8b")
    assert capsys.readouterr().out.strip() == "llama3:8b -> gpu-text"


def test_alias_and_capabilities_are_honoured(fleet: None, capsys) -> None:
    call_command("nexus_route", "gpt-4", "--tools")
    out = capsys.readouterr().out.strip()
    assert out == "gpt-4 -> gpu-tools serving llama3:8b (via alias)"


def test_explain_lists_candidates_scores_and_exclusions(fleet: None, capsys) -> None:
    call_command("nexus_route", "llama3:8b", "--tools", "--explain")
    out = capsys.readouterr().out
    assert "strategy smart" in out
    assert "gpu-tools" in out and "score" in out
    assert "excluded gpu-text" in out and "tools" in out
    assert "excluded gpu-off" in out and "unhealthy" in out


def test_unknown_model_exits_non_zero_with_the_clients_error(
    fleet: None, capsys
) -> None:
    with pytest.raises(CommandError) as raised:
        call_command("nexus_route", "gpt-5")
    assert raised.value.returncode == 2
    assert "404" in str(raised.value)
    assert "Model 'gpt-5' not found" in capsys.readouterr().out


def test_json_format_prints_the_decision_record(fleet: None, capsys) -> None:
    call_command("nexus_route", "llama3:8b", "--format", "json")
    record = json.loads(capsys.readouterr().out)
    assert record["chosen"] == {"backend": "gpu-text", "model": "llama3:8b"}
    assert [t["backend"] for t in record["retry_order"]] == ["gpu-tools"]


def test_empty_model_is_a_clear_error() -> None:
    with pytest.raises(CommandError, match="400"):
        call_command("nexus_route", "  ")


def test_explain_shows_the_policy_weights_beside_each_score(
    fleet: None, capsys
) -> None:
    RoutingPolicy.objects.create(weight_priority=60, weight_load=30, weight_latency=10)

    call_command("nexus_route", "llama3:8b", "--explain")

    out = capsys.readouterr().out
    assert "strategy smart (weights: priority 60, load 30, latency 10)" in out
    assert "score = prio×60% + load×30% + latency×10%" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("gpu-text"))
    # Idle and never measured: full marks for load and latency.
    score = next(part for part in row.split("  ") if " = " in part)
    total, parts = score.split(" = ")
    priority = float(parts.split("×")[0])
    assert parts == f"{priority:g}×60% + 100×30% + 100×10%"
    assert float(total) == pytest.approx(priority * 0.6 + 30 + 10, abs=0.01)


def test_json_format_carries_the_weights(fleet: None, capsys) -> None:
    call_command("nexus_route", "llama3:8b", "--format", "json")

    record = json.loads(capsys.readouterr().out)
    assert record["weights"] == {"priority": 50, "load": 30, "latency": 20}
