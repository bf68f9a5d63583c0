"""A database outage: the admin and dashboard say so (503), /health too, /v1 serves.

Production mode only: Nexus reaches PostgreSQL through a TCP forwarder the
test cuts (tests/tcp_cut.py), as if the database went down, and restores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import import_module

import httpx
import pytest
from django.conf import settings
from django.contrib.auth import (
    BACKEND_SESSION_KEY,
    HASH_SESSION_KEY,
    SESSION_KEY,
    get_user_model,
)
from django.db import connection

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import MockBackendProcess, NexusServer
from tests.tcp_cut import TcpCut
from usage.models import ApiKey, UsageRecord

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not settings.NEXUS_PRODUCTION,
        reason="the embedded default's SQLite file cannot go down",
    ),
]


def _staff_session_cookie() -> dict[str, str]:
    user = get_user_model().objects.create_user(
        "outage-ops", password="x", is_staff=True, is_superuser=True
    )
    engine = import_module(settings.SESSION_ENGINE)
    session = engine.SessionStore()
    session[SESSION_KEY] = str(user.pk)
    session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    session[HASH_SESSION_KEY] = user.get_session_auth_hash()
    session.save()
    return {settings.SESSION_COOKIE_NAME: session.session_key}


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_pages_answer_503_while_the_database_is_down_and_recover(
    nexus_server_factory: Callable[..., NexusServer],
    mock_backend: MockBackendProcess,
) -> None:
    backend = Backend.objects.create(
        name="mock-outage", base_url=mock_backend.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name="llama3:8b")
    _, key = ApiKey.objects.create_key("outage")
    cookies = _staff_session_cookie()
    db = connection.settings_dict
    cutter = TcpCut((db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)))
    try:
        nexus = nexus_server_factory(
            DATABASE_URL=f"postgres://{db['USER']}@127.0.0.1:{cutter.port}/{db['NAME']}",
            DB_CONN_MAX_AGE="60",
        )
        base = nexus.base_url
        sdk_headers = {"authorization": f"Bearer {key}"}
        chat = {"model": "llama3:8b", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.get(f"{base}/admin/", cookies=cookies).status_code == 200
        assert (
            httpx.post(
                f"{base}/v1/chat/completions",
                json=chat,
                headers=sdk_headers,
                timeout=10,
            ).status_code
            == 200
        )

        cutter.cut()
        for path in ("/admin/", "/admin/backends/backend/", "/dashboard/"):
            page = httpx.get(f"{base}{path}", cookies=cookies, timeout=20)
            assert page.status_code == 503, (path, page.text[:300])
            assert "configuration database is unreachable" in page.text
            assert page.headers["retry-after"] == "10"
        api = httpx.get(f"{base}/api/v1/backends", cookies=cookies, timeout=20)
        assert api.status_code == 503
        assert api.json()["code"] == "database_unreachable"
        health = httpx.get(f"{base}/health", timeout=20)
        assert health.status_code == 200  # the gateway still routes
        assert health.json()["database"] == "unreachable"
        assert health.json()["serving_backends"] == 1
        # The gateway serves from its last configuration meanwhile.
        served = httpx.post(
            f"{base}/v1/chat/completions", json=chat, headers=sdk_headers, timeout=10
        )
        assert served.status_code == 200
        request_id = served.headers["x-request-id"]

        cutter.restore()
        _wait_for(
            lambda: (
                httpx.get(f"{base}/admin/", cookies=cookies, timeout=20).status_code
                == 200
            ),
            "the admin did not come back after the database did",
        )
        assert httpx.get(f"{base}/health", timeout=20).json()["database"] == "ok"
        # And the usage of the request served during the outage is not lost.
        if settings.NEXUS_USAGE_TRANSPORT == "redis":
            from usage.stream import drain_usage_stream

            _wait_for(
                lambda: (
                    drain_usage_stream() >= 0
                    and UsageRecord.objects.filter(request_id=request_id).exists()
                ),
                "usage of the request served during the outage was lost",
            )
        else:
            _wait_for(
                lambda: UsageRecord.objects.filter(request_id=request_id).exists(),
                "usage of the request served during the outage was lost",
            )
    finally:
        cutter.close()
