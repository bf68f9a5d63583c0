"""Admin login lockout (django-axes) through real serving processes."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest
from axes.models import AccessAttempt, AccessFailureLog
from django.contrib.auth import get_user_model

from tests.conftest import NexusServer

USER = "lock-op"
PASSWORD = "lock-password-8841"
LIMIT = 5


def _log_in(server: NexusServer, username: str, password: str) -> httpx.Response:
    with httpx.Client(base_url=server.base_url, timeout=10) as browser:
        form = browser.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
        assert token is not None
        return browser.post(
            "/admin/login/?next=/admin/",
            data={
                "csrfmiddlewaretoken": token.group(1),
                "username": username,
                "password": password,
            },
        )


@pytest.mark.django_db(transaction=True)
def test_repeated_wrong_passwords_lock_that_user_and_address_in_every_process(
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    get_user_model().objects.create_superuser(USER, "lock@example.com", PASSWORD)
    get_user_model().objects.create_superuser("other-op", "o@example.com", PASSWORD)
    # Two serving processes: the count is shared, not per process.
    first = nexus_server_factory(NEXUS_LOGIN_FAILURE_LIMIT=str(LIMIT))
    second = nexus_server_factory(NEXUS_LOGIN_FAILURE_LIMIT=str(LIMIT))

    statuses = [
        _log_in(first if attempt % 2 else second, USER, "wrong").status_code
        for attempt in range(LIMIT + 2)
    ]

    # The form again with its error, until the limit; then 429, on both.
    assert statuses[: LIMIT - 1] == [200] * (LIMIT - 1)
    assert statuses[LIMIT - 1 :] == [429] * 3
    locked = _log_in(first, USER, PASSWORD)  # even the right password now
    assert locked.status_code == 429
    assert "Too many failed logins for “lock-op”" in locked.text
    assert _log_in(second, USER, PASSWORD).status_code == 429
    # Another user from the same address is not locked out.
    assert _log_in(first, "other-op", PASSWORD).status_code == 302

    attempt = AccessAttempt.objects.get(username=USER)
    assert attempt.failures_since_start >= LIMIT
    assert attempt.ip_address == "127.0.0.1"
    assert AccessFailureLog.objects.filter(username=USER).count() >= LIMIT
    log = "".join(first.log + second.log)
    assert "AXES: New login failure by" in log
    assert "AXES: Locking out" in log and "lock-op" in log

    # Staff see it in the admin, and deleting the attempt unlocks.
    with httpx.Client(base_url=first.base_url, timeout=10) as admin:
        form = admin.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
        assert token is not None
        admin.post(
            "/admin/login/",
            data={
                "csrfmiddlewaretoken": token.group(1),
                "username": "other-op",
                "password": PASSWORD,
            },
        )
        attempts = admin.get("/admin/axes/accessattempt/")
        assert attempts.status_code == 200
        assert USER in attempts.text
    attempt.delete()
    assert _log_in(second, USER, PASSWORD).status_code == 302
