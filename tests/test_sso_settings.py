"""Single sign-on settings, the login page, and a provider that is down."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import Client

from nexus_site.sso.discovery import forget_document
from tests.conftest import _free_port
from tests.test_settings import _load_settings

SSO = {
    "NEXUS_OIDC_DISCOVERY_URL": "https://idp.example.test/realms/main",
    "NEXUS_OIDC_CLIENT_ID": "nexus",
    "NEXUS_OIDC_CLIENT_SECRET": "s3cret",
}


@pytest.mark.mode_independent
@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"NEXUS_OIDC_ROLE_MAP": "ops=superhero"},
            "NEXUS_OIDC_ROLE_MAP: ops=superhero",
        ),
        ({"NEXUS_OIDC_ROLE_MAP": "leads=team-admin:"}, "team-admin:TEAM"),
        ({"NEXUS_OIDC_DISCOVERY_URL": "https://idp"}, "NEXUS_OIDC_CLIENT_ID"),
        ({"NEXUS_LOCAL_LOGIN": "false"}, "nobody could sign in"),
        ({"NEXUS_BREAK_GLASS_USER": "glass"}, "both NEXUS_BREAK_GLASS_USER"),
    ],
)
def test_settings_nobody_could_use_stop_startup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        _load_settings(monkeypatch, tmp_path, **env)


@pytest.mark.mode_independent
def test_sso_settings_reach_the_oidc_client_and_the_backends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values = _load_settings(
        monkeypatch,
        tmp_path,
        **SSO,
        NEXUS_OIDC_ROLE_MAP="admins=admin,leads=team-admin:research",
        NEXUS_LOCAL_LOGIN="false",
        NEXUS_BREAK_GLASS_USER="glass",
        NEXUS_BREAK_GLASS_PASSWORD="pw-0123456789",
    )

    assert values["OIDC_RP_CLIENT_ID"] == "nexus"
    assert values["NEXUS_OIDC_ROLE_MAP"] == {
        "admins": "admin",
        "leads": "team-admin:research",
    }
    assert values["AUTHENTICATION_BACKENDS"] == [
        "axes.backends.AxesStandaloneBackend",
        "nexus_site.sso.backends.PermissionsOnlyBackend",
        "nexus_site.sso.backends.NexusOIDCBackend",
        "nexus_site.sso.backends.BreakGlassBackend",
    ]


@pytest.mark.django_db
def test_a_provider_that_cannot_be_reached_sends_back_to_the_login_page(
    client: Client, settings: Any
) -> None:
    settings.NEXUS_OIDC_ENABLED = True
    settings.NEXUS_OIDC_DISCOVERY_URL = f"http://127.0.0.1:{_free_port()}/idp"
    settings.NEXUS_OIDC_TIMEOUT = 2.0
    forget_document()
    try:
        start = client.get("/oidc/authenticate/?next=/admin/")
        login = client.get(start["Location"])
    finally:
        forget_document()

    assert start.status_code == 302
    assert start["Location"] == "/admin/login/?sso=unavailable"
    assert "cannot be reached" in login.content.decode()
    assert "Sign in with single sign-on" in login.content.decode()


@pytest.mark.django_db
def test_with_sso_off_the_login_page_is_djangos(client: Client) -> None:
    page = client.get("/admin/login/").content.decode()

    assert "Sign in with" not in page
    assert 'name="password"' in page and "break-glass" not in page
