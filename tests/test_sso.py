"""Single sign-on against a real OpenID provider, with local passwords off.

The provider is django-oauth-toolkit's, in a Django process of its own
(tests/oidc_provider); Nexus is a real Daphne process configured with
NEXUS_OIDC_*, NEXUS_LOCAL_LOGIN=false and a break-glass account. A browser is
played by an httpx client that keeps cookies and follows each redirect by
hand: Nexus's sign-in page, the provider's login form, its authorization
endpoint, Nexus's callback (where Nexus, server to server, exchanges the code
for tokens, checks the ID token against the provider's keys and reads the
user's claims). Nothing leaves the loopback.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urljoin

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from nexus_site.staff_roles import ADMIN, OPERATOR, TEAM_ADMIN
from tests.conftest import NexusServer, _free_port, start_nexus_server
from tests.oidc_provider.accounts import CLIENT_ID, CLIENT_SECRET, USERS
from tests.oidc_provider.process import Provider, start_provider
from usage.models import Team

BREAK_GLASS = ("breakglass", "break-glass-pw-0123456789")
LOCAL = ("local-admin", "local-pw-0123456789")


@dataclass
class Setup:
    provider: Provider
    nexus: NexusServer


@pytest.fixture(scope="module")
def setup(
    django_db_setup: None, django_db_blocker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    provider = start_provider(tmp_path_factory.mktemp("oidc"), _free_port())
    with django_db_blocker.unblock():
        Team.objects.create(name="research")
        get_user_model().objects.create_user(
            LOCAL[0], password=LOCAL[1], is_staff=True, is_superuser=True
        )
    nexus = None
    try:
        nexus = start_nexus_server(
            NEXUS_OIDC_DISCOVERY_URL=f"{provider.url}/o",
            NEXUS_OIDC_CLIENT_ID=CLIENT_ID,
            NEXUS_OIDC_CLIENT_SECRET=CLIENT_SECRET,
            NEXUS_OIDC_PROVIDER_NAME="Test IdP",
            NEXUS_OIDC_ROLE_MAP=(
                "nexus-admins=admin,ml-ops=operator,team-research=team-admin:research"
            ),
            NEXUS_LOCAL_LOGIN="false",
            NEXUS_BREAK_GLASS_USER=BREAK_GLASS[0],
            NEXUS_BREAK_GLASS_PASSWORD=BREAK_GLASS[1],
        )
        provider.register_client(f"{nexus.base_url}/oidc/callback/")
        yield Setup(provider, nexus)
    finally:
        if nexus is not None:
            nexus.stop()
        provider.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture
def database(django_db_blocker) -> Iterator[None]:
    """Reads of what the server wrote, outside any test transaction (one would
    hold SQLite's lock against the server in the embedded default)."""
    with django_db_blocker.unblock():
        yield


def _form_token(page: httpx.Response) -> str:
    found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert found, page.text[:500]
    return found.group(1)


def _follow(browser: httpx.Client, response: httpx.Response) -> httpx.Response:
    """Follow redirects one by one (cookies set on the way are kept)."""
    for _ in range(10):
        if response.status_code not in (301, 302, 303):
            return response
        response = browser.get(urljoin(str(response.url), response.headers["location"]))
    raise AssertionError("too many redirects")


def _sign_in(setup: Setup, username: str) -> tuple[httpx.Client, httpx.Response]:
    """Sign in to Nexus through the provider; return the browser and where it
    ended (the page after Nexus's callback)."""
    browser = httpx.Client(timeout=20)
    start = browser.get(f"{setup.nexus.base_url}/oidc/authenticate/?next=/admin/")
    assert start.status_code == 302
    authorize = start.headers["location"]
    assert authorize.startswith(f"{setup.provider.url}/o/authorize/")
    login_page = browser.get(f"{setup.provider.url}/accounts/login/")
    logged_in = browser.post(
        f"{setup.provider.url}/accounts/login/",
        data={
            "username": username,
            "password": USERS[username][0],
            "csrfmiddlewaretoken": _form_token(login_page),
            "next": authorize.removeprefix(setup.provider.url),
        },
    )
    assert logged_in.status_code == 302, logged_in.text[:300]
    return browser, _follow(browser, logged_in)


def _user(username: str):
    return get_user_model().objects.get(username__startswith=f"sso:{username}:")


def _roles(user) -> set[str]:
    return set(user.groups.values_list("name", flat=True))


def test_the_login_page_offers_single_sign_on_and_folds_the_password_form_away(
    setup: Setup,
) -> None:
    page = httpx.get(f"{setup.nexus.base_url}/admin/login/?next=/admin/")

    assert "Sign in with Test IdP" in page.text
    assert '<details id="break-glass">' in page.text


def test_group_claims_map_to_roles_in_the_admin(setup: Setup, database: None) -> None:
    admin, landed = _sign_in(setup, "ada")
    operator, _ = _sign_in(setup, "olga")

    assert landed.status_code == 200 and str(landed.url).endswith("/admin/")
    ada, olga = _user("ada"), _user("olga")
    assert _roles(ada) == {ADMIN} and ada.is_staff and not ada.is_superuser
    assert _roles(olga) == {OPERATOR} and olga.email == "olga@example.test"
    base = setup.nexus.base_url
    # An admin adds keys and users; an operator changes routing, not keys.
    assert admin.get(f"{base}/admin/usage/apikey/add/").status_code == 200
    assert admin.get(f"{base}/admin/auth/user/").status_code == 200
    assert operator.get(f"{base}/admin/routing/alias/add/").status_code == 200
    assert operator.get(f"{base}/admin/usage/apikey/add/").status_code == 403
    assert operator.get(f"{base}/dashboard/").status_code == 200


def test_a_team_group_makes_its_members_that_teams_admins(
    setup: Setup, database: None
) -> None:
    browser, landed = _sign_in(setup, "tess")

    tess = _user("tess")
    assert landed.status_code == 200
    assert _roles(tess) == {TEAM_ADMIN}
    assert list(tess.administered_teams.values_list("name", flat=True)) == ["research"]
    keys = browser.get(f"{setup.nexus.base_url}/admin/usage/apikey/")
    assert keys.status_code == 200


def test_a_user_whose_groups_map_to_no_role_is_refused(
    setup: Setup, database: None
) -> None:
    browser, landed = _sign_in(setup, "nora")

    assert "/admin/login/" in str(landed.url) and "sso=failed" in str(landed.url)
    assert "no role in Nexus" in landed.text
    assert browser.get(f"{setup.nexus.base_url}/admin/").status_code == 302
    assert (
        not get_user_model()
        .objects.filter(username__startswith="sso:nora:", is_staff=True)
        .exists()
    )


def _password_login(setup: Setup, username: str, password: str) -> httpx.Response:
    browser = httpx.Client(timeout=10)
    url = f"{setup.nexus.base_url}/admin/login/?next=/admin/"
    page = browser.get(url)
    return browser.post(
        url,
        data={
            "username": username,
            "password": password,
            "csrfmiddlewaretoken": _form_token(page),
            "next": "/admin/",
        },
    )


def test_local_passwords_are_off_but_the_break_glass_account_signs_in(
    setup: Setup, database: None
) -> None:
    local = _password_login(setup, *LOCAL)
    glass = _password_login(setup, *BREAK_GLASS)
    wrong = _password_login(setup, BREAK_GLASS[0], "not-the-password")

    assert local.status_code == 200 and "errornote" in local.text  # refused
    assert glass.status_code == 302 and glass.headers["location"] == "/admin/"
    assert wrong.status_code == 200 and "errornote" in wrong.text
    account = get_user_model().objects.get(username=BREAK_GLASS[0])
    assert account.is_superuser and not account.has_usable_password()
