"""A change that loses a database conflict answers 503 "busy, retry", not "unreachable".

A deadlock, a serialization failure or a lock wait that timed out is a
PostgreSQL OperationalError, as a lost connection is; before, the admin and
the API told the operator the database was unreachable while it was up (a
health round and a delete once deadlocked that way).
"""

from __future__ import annotations

import psycopg
import pytest
from django.conf import settings
from django.db import OperationalError, connection
from django.test import Client, RequestFactory
from rest_framework.authtoken.models import Token

from backends.models import Backend
from nexus_site.middleware import DatabaseOutageMiddleware
from tests.factories import StaffUserFactory

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not settings.NEXUS_PRODUCTION,
        reason="row locks that time out are PostgreSQL's",
    ),
]


def _dsn() -> str:
    db = connection.settings_dict
    return (
        f"host={db['HOST'] or '127.0.0.1'} port={db['PORT'] or 5432} "
        f"user={db['USER']} dbname={db['NAME']}"
    )


def test_a_change_blocked_by_a_row_lock_answers_busy_and_saves_nothing() -> None:
    backend = Backend.objects.create(name="locked", base_url="http://127.0.0.1:9")
    token = Token.objects.create(user=StaffUserFactory())
    with psycopg.connect(_dsn()) as other:
        other.execute(
            "SELECT id FROM backends_backend WHERE id = %s FOR UPDATE", [backend.pk]
        )
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
        try:
            answer = Client().patch(
                f"/api/v1/backends/{backend.pk}",
                data={"enabled": False},
                content_type="application/json",
                HTTP_AUTHORIZATION=f"Token {token.key}",
            )
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
        other.rollback()
    assert answer.status_code == 503, answer.content[:300]
    assert answer.json()["code"] == "database_busy"
    assert "Retry the request" in answer.json()["detail"]
    assert answer["Retry-After"] == "1"
    backend.refresh_from_db()
    assert backend.enabled is True


def test_an_admin_page_that_loses_a_conflict_says_so() -> None:
    backend = Backend.objects.create(name="locked", base_url="http://127.0.0.1:9")
    with psycopg.connect(_dsn()) as other:
        other.execute(
            "SELECT id FROM backends_backend WHERE id = %s FOR UPDATE", [backend.pk]
        )
        conflict: OperationalError | None = None
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
            try:
                cursor.execute(
                    "UPDATE backends_backend SET enabled = false WHERE id = %s",
                    [backend.pk],
                )
            except OperationalError as error:
                conflict = error
            finally:
                cursor.execute("RESET lock_timeout")
        other.rollback()
    assert conflict is not None
    middleware = DatabaseOutageMiddleware(lambda request: None)  # type: ignore[arg-type,return-value]
    page = middleware.process_exception(
        RequestFactory().post(f"/admin/backends/backend/{backend.pk}/change/"), conflict
    )
    assert page is not None and page.status_code == 503
    assert "was busy" in page.content.decode()
    assert "unreachable" not in page.content.decode()
    assert page["Retry-After"] == "1"
