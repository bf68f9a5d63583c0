"""Who reaches what: every role against every surface of a real Nexus server.

One table, role x endpoint x expected status, checked against a Daphne
process serving Nexus (the gateway's /v1, /metrics and the usage stream are
plain ASGI, outside Django's URLs, so only a real server shows them all).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils.crypto import get_random_string
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from nexus_lib.permissions import AnyStaffPermission, required_permissions
from nexus_site.staff_roles import (
    ADMIN,
    KEY_ADMIN,
    OPERATOR,
    TEAM_ADMIN,
    VIEWER,
    grants,
    set_role,
)
from nexus_site.staff_roles import ROLES as ROLE_NAMES
from tests.conftest import NexusServer
from usage.models import ApiKey

ROLES = ("anonymous", "client key", "member session", "staff session", "staff token")


@dataclass(frozen=True)
class Row:
    method: str
    path: str
    expected: tuple[int, int, int, int, int]  # in the order of ROLES
    body: dict[str, Any] | None = None


CHAT = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
ALIAS = {"name": "alias-{role}", "target": "llama3:8b"}

#           anonymous, client key, member session, staff session, staff token
TABLE = (
    Row("GET", "/v1/models", (401, 200, 401, 401, 401)),
    Row("POST", "/v1/chat/completions", (401, 404, 401, 401, 401), CHAT),
    Row("GET", "/health", (200, 200, 200, 200, 200)),
    Row("GET", "/health/live", (200, 200, 200, 200, 200)),
    Row("GET", "/metrics", (200, 200, 200, 200, 200)),  # from loopback
    Row("GET", "/api/v1/", (401, 401, 403, 200, 200)),
    Row("GET", "/api/v1/backends", (401, 401, 403, 200, 200)),
    Row("POST", "/api/v1/aliases", (401, 401, 403, 201, 201), ALIAS),
    Row("GET", "/api/v1/keys", (401, 401, 403, 200, 200)),
    Row("POST", "/api/v1/keys", (401, 401, 403, 201, 201), {"name": "{role}"}),
    Row("GET", "/api/v1/config/export", (401, 401, 403, 200, 200)),
    Row("GET", "/api/v1/cache", (401, 401, 403, 200, 200)),
    Row("GET", "/api/v1/usage/stats", (401, 401, 403, 200, 200)),
    Row("GET", "/api/v1/schema/", (401, 401, 403, 200, 200)),
    Row("GET", "/api/usage-stream", (401, 401, 403, 200, 200)),
    Row("GET", "/api/usage-stream/", (401, 401, 403, 200, 200)),
    Row("GET", "/api/v1/docs/", (302, 302, 302, 200, 302)),
    Row("GET", "/dashboard/", (302, 302, 302, 200, 302)),
    Row("GET", "/dashboard/history", (403, 403, 403, 200, 403)),
    Row("GET", "/admin/", (302, 302, 302, 200, 302)),
    Row("GET", "/admin/backends/backend/", (302, 302, 302, 200, 302)),
)


def _session_headers(user: Any) -> dict[str, str]:
    """Cookies of a logged-in browser (the session row is in the shared DB)."""
    browser = Client()
    browser.force_login(user)
    csrf = get_random_string(32)
    session = browser.cookies["sessionid"].value
    return {"Cookie": f"sessionid={session}; csrftoken={csrf}", "X-CSRFToken": csrf}


def _role_headers() -> dict[str, dict[str, str]]:
    users = get_user_model().objects
    staff = users.create_user("matrix-staff", is_staff=True, is_superuser=True)
    member = users.create_user("matrix-member", is_staff=False)
    _, client_key = ApiKey.objects.create_key("matrix")
    token = Token.objects.create(user=staff)
    return {
        "anonymous": {},
        "client key": {"Authorization": f"Bearer {client_key}"},
        "member session": _session_headers(member),
        "staff session": _session_headers(staff),
        "staff token": {"Authorization": f"Token {token.key}"},
    }


def _status(server: NexusServer, row: Row, role: str, headers: dict[str, str]) -> int:
    body = None
    if row.body is not None:
        body = {
            k: v.format(role=role.replace(" ", "-")) if isinstance(v, str) else v
            for k, v in row.body.items()
        }
    # A stream: the status line is enough.
    with httpx.stream(
        row.method,
        f"{server.base_url}{row.path}",
        headers=headers,
        json=body,
        timeout=10,
        follow_redirects=False,
    ) as response:
        return response.status_code


@pytest.mark.django_db(transaction=True)
def test_each_role_reaches_exactly_what_it_should(
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    backend = Backend.objects.create(
        name="matrix-gpu", base_url="http://127.0.0.1:9", status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name="llama3:8b")
    headers = _role_headers()
    server = nexus_server_factory()

    wrong = []
    for row in TABLE:
        for role, expected in zip(ROLES, row.expected, strict=True):
            got = _status(server, row, role, headers[role])
            if got != expected:
                wrong.append(
                    f"{role:>14}  {row.method} {row.path}: {got}, not {expected}"
                )

    assert not wrong, "\n".join(["access matrix mismatches:", *wrong])


# Roles ---------------------------------------------------------------------
#
# Every role against every management API endpoint and every admin list,
# found in the URL conf and the admin registry (so endpoints and models added
# later are covered without editing this file), plus the pages, each against
# the one rule of nexus_site/staff_roles.py: default deny.

STAFF_ROLES = (*ROLE_NAMES, "no role")
PROBE_ID = "999999"  # detail routes: the permission is checked before the lookup
SECRET = "sk-backend-secret-never-shown"


def _api_routes() -> list[tuple[str, str, Any]]:
    """(path, method, view instance) of every management API endpoint."""
    routes = []
    for pattern, callback in _walk(get_resolver().url_patterns, ""):
        if not pattern.startswith("api/v1/") or "format" in pattern:
            continue
        path = "/" + re.sub(r"\(\?P<\w+>[^)]*\)|<[^>]+>", PROBE_ID, pattern)
        path = path.replace("^", "").replace("$", "")
        view_class = getattr(callback, "cls", None)
        if view_class is None:
            continue
        actions = getattr(callback, "actions", None)
        if actions is not None:
            methods = {method.upper(): action for method, action in actions.items()}
        else:
            methods = {
                method.upper(): None
                for method in ("get", "post", "put", "patch", "delete")
                if hasattr(view_class, method)
            }
        for method, action in methods.items():
            view = view_class()
            view.action = action
            routes.append((path, method, view))
    return routes


def _walk(patterns: list[Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for entry in patterns:
        if isinstance(entry, URLResolver):
            yield from _walk(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            yield prefix + str(entry.pattern), entry.callback


def _role_may(role: str, view: Any, method: str) -> bool:
    """What the rule says: the permissions the view needs, by role."""
    if AnyStaffPermission in getattr(view, "permission_classes", ()):
        return True
    if role == ADMIN:
        return True
    needed = required_permissions(view, method)
    if needed is None or role == "no role":
        return False
    return all(grants(role, *name.split(".")) for name in needed)


def _role_users() -> dict[str, Any]:
    users = get_user_model().objects
    found = {}
    for role in STAFF_ROLES:
        user = users.create_user(f"role-{role.replace(' ', '-')}", is_staff=True)
        if role != "no role":
            set_role(user, role)
        found[role] = user
    return found


@pytest.mark.django_db(transaction=True)
def test_every_role_reaches_exactly_what_the_role_rule_gives_it(
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    Backend.objects.create(
        name="roles-gpu", base_url="http://127.0.0.1:9", api_key=SECRET
    )
    users = _role_users()
    tokens = {role: Token.objects.create(user=user).key for role, user in users.items()}
    sessions = {role: _session_headers(user) for role, user in users.items()}
    routes = _api_routes()
    assert len({path for path, _, _ in routes}) >= 25, "the URL conf was not walked"
    server = nexus_server_factory()

    wrong = []
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        for role in STAFF_ROLES:
            auth = {"Authorization": f"Token {tokens[role]}"}
            for path, method, view in routes:
                body = None if method in ("GET", "DELETE") else {}
                got = http.request(method, path, headers=auth, json=body).status_code
                allowed = _role_may(role, view, method)
                if allowed == (got in (401, 403)):
                    wrong.append(
                        f"{role:>10} {method} {path}: {got}, allowed={allowed}"
                    )
            for model in admin.site._registry:
                meta = model._meta
                path = f"/admin/{meta.app_label}/{meta.model_name}/"
                got = http.get(path, headers=sessions[role]).status_code
                allowed = role == ADMIN or any(
                    role != "no role"
                    and grants(role, meta.app_label, f"{a}_{meta.model_name}")
                    for a in ("view", "change")
                )
                # A singleton's list redirects to its one page (302).
                if allowed != (got in (200, 302)):
                    wrong.append(f"{role:>10} GET {path}: {got}, allowed={allowed}")
            for path, dashboard in PAGES:
                # The usage stream never ends: the status line is enough.
                with http.stream("GET", path, headers=sessions[role]) as page:
                    got = page.status_code
                allowed = role not in ("no role", TEAM_ADMIN) or not dashboard
                if allowed != (got == 200):
                    wrong.append(f"{role:>10} GET {path}: {got}, allowed={allowed}")
            # A viewer sees no secret anywhere: nor does any other role.
            for path in ("/api/v1/backends", "/api/v1/config/export", "/api/v1/config"):
                assert SECRET not in http.get(path, headers=auth).text, (role, path)

    assert not wrong, "\n".join(["role matrix mismatches:", *wrong])


# (path, dashboard: needs the usage view of the global roles)
PAGES = (
    ("/admin/", False),
    ("/dashboard/", True),
    ("/dashboard/history", True),
    ("/dashboard/fleet", True),
    ("/api/usage-stream", True),
)


@pytest.mark.django_db
def test_the_roles_mean_what_the_docs_say() -> None:
    """The rule in words: spot checks that do not go through the rule's code."""
    users = _role_users()

    def may(role: str, permission: str) -> bool:
        return bool(users[role].has_perm(permission))

    assert may(VIEWER, "backends.view_backend") and not may(
        VIEWER, "backends.change_backend"
    )
    assert may(OPERATOR, "routing.add_alias") and may(
        OPERATOR, "backends.change_backend"
    )
    assert not may(OPERATOR, "usage.add_apikey")
    assert may(KEY_ADMIN, "usage.add_apikey") and may(KEY_ADMIN, "usage.change_team")
    assert not may(KEY_ADMIN, "routing.change_alias")
    assert may(TEAM_ADMIN, "usage.change_apikey") and not may(
        TEAM_ADMIN, "usage.manage_all_teams"
    )
    assert not may(TEAM_ADMIN, "usage.view_tokenusage")
    assert may(ADMIN, "auth.change_user") and not may(KEY_ADMIN, "auth.change_user")
    for role in (VIEWER, OPERATOR, KEY_ADMIN, TEAM_ADMIN):
        assert not may(role, "authtoken.view_tokenproxy"), role
        assert not may(role, "auth.view_user"), role
