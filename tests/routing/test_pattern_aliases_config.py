"""Pattern aliases (``claude-*``) where operators meet them: the admin, the
REST API, the TOML file and ``nexus_route``; and the alias list's judgement of
whether an alias routes (its fallback chain included)."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from routing.models import Alias, FallbackChain
from tests.factories import (
    AliasFactory,
    BackendFactory,
    BackendModelFactory,
    StaffUserFactory,
)

pytestmark = pytest.mark.django_db

ALIAS_ADD = reverse("admin:routing_alias_add")
ALIAS_LIST = reverse("admin:routing_alias_changelist")
CLAUDE = "claude-sonnet-4-6"


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(StaffUserFactory())
    return client


def _rows(admin_client: Client) -> dict[str, tuple[str, bool, str]]:
    listed = admin_client.get(ALIAS_LIST)
    admin = listed.context["cl"].model_admin
    return {
        alias.name: (admin.kind(alias), admin.routes(alias), admin.serves(alias))
        for alias in listed.context["cl"].result_list
    }


# --- the admin -----------------------------------------------------------------


def test_the_admin_stores_a_pattern_and_lists_it_as_one(admin_client: Client) -> None:
    BackendModelFactory(name="llama3:8b")
    saved = admin_client.post(
        ALIAS_ADD, {"name": "claude-*", "target": "llama3:8b"}, follow=True
    )
    assert saved.status_code == 200
    assert Alias.objects.get().is_pattern
    assert _rows(admin_client) == {"claude-*": ("pattern", True, "llama3:8b")}
    page = admin_client.get(ALIAS_ADD).content.decode()
    assert "or a pattern with * (any characters)" in page


@pytest.mark.parametrize(
    ("name", "target", "error"),
    [
        ("claude-[0-9]*", "llama3:8b", "A pattern may use only '*'"),
        ("claude-*", "llama3:*", "'llama3:*' is a pattern; the target must be"),
    ],
)
def test_the_admin_refuses_a_pattern_it_cannot_match(
    admin_client: Client, name: str, target: str, error: str
) -> None:
    response = admin_client.post(ALIAS_ADD, {"name": name, "target": target})
    assert response.status_code == 200  # the form again, with the error
    assert error in response.content.decode().replace("&#x27;", "'")
    assert not Alias.objects.exists()


def test_an_alias_that_serves_through_its_fallback_chain_routes(
    admin_client: Client,
) -> None:
    # The red team's case: gpt-4 -> llama3:70b (served nowhere), with a chain
    # gpt-4 -> mistral:7b that serves it. It used to get a red cross.
    BackendModelFactory(name="mistral:7b")
    BackendModelFactory(name="retired", enabled=False)
    AliasFactory(name="gpt-4", target="llama3:70b")
    AliasFactory(name="old", target="retired")
    chain = FallbackChain.objects.create(model="gpt-4")
    chain.set_fallbacks(["mistral:7b"])
    assert _rows(admin_client) == {
        "gpt-4": ("exact", True, "mistral:7b (fallback)"),
        "old": ("exact", False, "-"),
    }


def test_saving_an_alias_that_routes_nowhere_warns(admin_client: Client) -> None:
    saved = admin_client.post(
        ALIAS_ADD, {"name": "claude-*", "target": "llama3:70b"}, follow=True
    )
    assert (
        "No enabled backend serves 'llama3:70b' (nor a model of its fallback "
        "chain) yet: requests for names matching 'claude-*' get 404"
    ) in saved.content.decode().replace("&#x27;", "'")


def test_a_pattern_cannot_be_a_fallback_step(admin_client: Client) -> None:
    chain = FallbackChain.objects.create(model="gpt-4")
    with pytest.raises(Exception, match="is a pattern; a fallback is one model"):
        chain.set_fallbacks(["llama3:*"])


# --- the REST API --------------------------------------------------------------


def test_the_api_says_which_aliases_are_patterns(api: APIClient) -> None:
    BackendModelFactory(name="llama3:8b")
    created = api.post(
        "/api/v1/aliases", {"name": "claude-*", "target": "llama3:8b"}, format="json"
    )
    assert created.status_code == 201, created.json()
    assert created.json()["is_pattern"] is True
    api.post("/api/v1/aliases", {"name": "gpt-4", "target": "llama3:8b"}, format="json")
    config = api.get("/api/v1/config").json()
    assert config["aliases"] == {"gpt-4": "llama3:8b"}
    assert config["alias_patterns"] == {"claude-*": "llama3:8b"}


def test_the_api_refuses_an_invalid_pattern(api: APIClient) -> None:
    refused = api.post(
        "/api/v1/aliases", {"name": "claude-{a,b}*", "target": "x"}, format="json"
    )
    assert refused.status_code == 400
    assert "only '*'" in str(refused.json())


# --- the TOML file -------------------------------------------------------------


def test_patterns_import_and_export_as_patterns(tmp_path: Path) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text(
        '[routing.aliases]\n"gpt-4" = "llama3:70b"\n"claude-*" = "llama3:8b"\n'
        '"claude-*haiku*" = "qwen:0.5b"\n',
        encoding="utf-8",
    )
    call_command("nexus_import_config", str(path), stdout=StringIO())
    assert dict(Alias.objects.values_list("name", "target")) == {
        "gpt-4": "llama3:70b",
        "claude-*": "llama3:8b",
        "claude-*haiku*": "qwen:0.5b",
    }
    out = StringIO()
    call_command("nexus_export_config", stdout=out)
    text = out.getvalue()
    section = text[text.index("[routing.aliases]") : text.index("[routing.fallbacks]")]
    assert section.strip().splitlines()[1:] == [
        "# Name a client asks for = the model served instead.",
        '"gpt-4" = "llama3:70b"',
        "# Patterns (* any characters, ? one): for names no backend serves and",
        "# no alias above names, the longest pattern first.",
        '"claude-*haiku*" = "qwen:0.5b"',
        '"claude-*" = "llama3:8b"',
    ]


def test_an_invalid_pattern_in_the_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text('[routing.aliases]\n"claude-[0-9]*" = "x"\n', encoding="utf-8")
    with pytest.raises(CommandError, match=r'routing.aliases."claude-\[0-9\]\*": A'):
        call_command("nexus_import_config", str(path), stdout=StringIO())
    assert not Alias.objects.exists()


# --- nexus_route ---------------------------------------------------------------


def test_nexus_route_explains_a_name_a_pattern_covers(capsys) -> None:
    BackendModelFactory(backend=BackendFactory(name="gpu"), name="llama3:8b")
    AliasFactory(name="claude-*", target="llama3:8b")
    call_command("nexus_route", CLAUDE, "--explain")
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == [
        f"{CLAUDE} -> gpu serving llama3:8b (via alias)",
        "(the alias pattern 'claude-*' covers this name)",
    ]
