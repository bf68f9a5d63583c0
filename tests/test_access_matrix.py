"""Who reaches what: every role against every surface of a real Nexus server.

One table, role x endpoint x expected status, checked against a Daphne
process serving Nexus (the gateway's /v1, /metrics and the usage stream are
plain ASGI, outside Django's URLs, so only a real server shows them all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils.crypto import get_random_string
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
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
