"""``[routing.ensemble]``: the file, the admin, the API and the snapshot agree."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse

from gateway.proxy.ensemble import prompts
from routing.core import Policy
from routing.core.ensemble_policy import (
    DEFAULT_CRITIQUE_PROMPT,
    DEFAULT_REFINE_PROMPT,
    EnsemblePolicy,
)
from routing.models import RoutingPolicy
from routing.snapshot import build_snapshot
from tests.routing.test_admin import policy_form

TOML = '''
[routing.ensemble]
opinions = 5
step_timeout_seconds = 30.5
critique_prompt = """Judge these for {question}:
{answers}
Write Answer <n>: <s>/10."""
'''
POLICY_PAGE = reverse(
    "admin:routing_routingpolicy_change", args=(RoutingPolicy.SINGLETON_PK,)
)


def _import(tmp_path: Path, text: str) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text(text)
    call_command("nexus_import_config", str(path), stdout=StringIO())


def test_three_opinions_and_the_default_prompts_by_default() -> None:
    policy = Policy().ensemble
    assert policy == EnsemblePolicy(3, "", "", 120.0)
    assert policy.critique_template == DEFAULT_CRITIQUE_PROMPT
    assert policy.refine_template == DEFAULT_REFINE_PROMPT


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"opinions": 0}, "opinions"),
        ({"opinions": 9}, "opinions"),
        ({"step_timeout_seconds": 0.5}, "step_timeout_seconds"),
        ({"step_timeout_seconds": float("nan")}, "step_timeout_seconds"),
        ({"critique_prompt": "no placeholder"}, "{answers}"),
        ({"refine_prompt": "{question} only"}, "{answer}"),
    ],
)
def test_out_of_range_settings_are_refused(
    values: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem.replace("{", r"\{")):
        EnsemblePolicy(**values)  # type: ignore[arg-type]


@pytest.mark.django_db
def test_the_file_sets_the_policy_the_gateway_reads(tmp_path: Path) -> None:
    assert build_snapshot().policy.ensemble.opinions == 3
    _import(tmp_path, TOML)
    ensemble = build_snapshot().policy.ensemble
    assert (ensemble.opinions, ensemble.step_timeout_seconds) == (5, 30.5)
    assert ensemble.critique_template.startswith("Judge these for {question}:\n")
    assert ensemble.refine_template == DEFAULT_REFINE_PROMPT
    out = StringIO()
    call_command("nexus_export_config", stdout=out)
    exported = out.getvalue()
    assert "[routing.ensemble]\n" in exported
    assert "opinions = 5" in exported.split("[routing.ensemble]")[1]
    RoutingPolicy.objects.all().delete()
    _import(tmp_path, exported)
    assert RoutingPolicy.load().ensemble_policy() == ensemble


@pytest.mark.django_db
def test_bad_file_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(CommandError) as caught:
        _import(tmp_path, "[routing.ensemble]\nopinions = 12\nvoters = 2\n")
    message = str(caught.value)
    assert "routing.ensemble.voters" in message
    with pytest.raises(CommandError) as caught:
        _import(tmp_path, '[routing.ensemble]\nrefine_prompt = "no place"\n')
    assert "routing.ensemble.refine_prompt" in str(caught.value)


@pytest.mark.django_db
def test_the_policy_api_sets_them_and_refuses_bad_values() -> None:
    from rest_framework.test import APIClient

    from tests.factories import StaffUserFactory

    api = APIClient()
    api.force_authenticate(StaffUserFactory())
    wrong = api.patch("/api/v1/policy", {"ensemble_opinions": 9}, format="json")
    assert wrong.status_code == 400
    assert "ensemble_opinions" in wrong.json()
    wrong = api.patch(
        "/api/v1/policy", {"ensemble_critique_prompt": "no answers"}, format="json"
    )
    assert wrong.status_code == 400
    assert "{answers}" in str(wrong.json()["ensemble_critique_prompt"])
    changed = api.patch(
        "/api/v1/policy",
        {"ensemble_opinions": 2, "ensemble_refine_prompt": "Better: {answer}"},
        format="json",
    )
    assert changed.status_code == 200, changed.json()
    assert changed.json()["ensemble_opinions"] == 2
    assert build_snapshot().policy.ensemble == EnsemblePolicy(
        opinions=2, refine_prompt="Better: {answer}"
    )


@pytest.mark.django_db
def test_the_admin_edits_them_on_the_policy_page(admin_client: Client) -> None:
    RoutingPolicy.load()
    page = admin_client.get(POLICY_PAGE)
    assert page.status_code == 200
    assert b"Multiple opinions" in page.content
    assert b"ensemble_critique_prompt" in page.content
    refused = admin_client.post(
        POLICY_PAGE, policy_form(ensemble_refine_prompt="nothing to refine")
    )
    assert refused.status_code == 200
    assert b"must contain {answer}" in refused.content
    saved = admin_client.post(
        POLICY_PAGE,
        policy_form(ensemble_opinions="4", ensemble_step_timeout_seconds="15"),
    )
    assert saved.status_code == 302
    assert build_snapshot().policy.ensemble == EnsemblePolicy(
        opinions=4, step_timeout_seconds=15.0
    )


@pytest.mark.django_db
def test_the_model_refuses_prompts_without_their_placeholder() -> None:
    policy = RoutingPolicy.load()
    policy.ensemble_critique_prompt = "Score them."
    with pytest.raises(ValidationError) as caught:
        policy.full_clean()
    assert "ensemble_critique_prompt" in caught.value.message_dict


def test_scores_are_read_robustly() -> None:
    critique = """Answer 1 is wrong about stability.
    **Answer 2**: 8/10
    Answer #3 - score: 7.5 out of 10
    Answer 1: 4/10 and Answer 4: 9/10
    Answer 5: 11/10
    Answer 6: great
    Answer <number>: <score>/10"""
    assert prompts.parse_scores(critique, [1, 2, 3, 5, 6]) == {
        1: 4.0,
        2: 8.0,
        3: 7.5,
    }
    assert prompts.parse_scores("I cannot decide.", [1, 2]) == {}


def test_the_best_mean_wins_and_ties_go_to_the_earliest() -> None:
    votes = [{2: 8.0, 3: 8.0}, {1: 5.0, 3: 9.5}, {1: 9.0, 2: 9.0}]
    assert prompts.rank([1, 2, 3], votes) == [3, 2, 1]
    assert prompts.rank([1, 2, 3], [{2: 7.0, 3: 7.0}]) == [2, 3, 1]
    assert prompts.rank([1, 2, 3], []) == [1, 2, 3]


def test_prompts_fill_their_placeholders_as_plain_text() -> None:
    others = [prompts.Opinion(1, "one {answer}"), prompts.Opinion(3, "three")]
    request = prompts.critique_request(
        "Q={question} {unknown} A={answers}", "why {x}?", others, "m"
    )
    text = request["messages"][0]["content"]
    assert text == (
        "Q=why {x}? {unknown} A=--- Answer 1 ---\none {answer}\n\n"
        "--- Answer 3 ---\nthree"
    )
    assert request["model"] == "m" and request["stream"] is False
