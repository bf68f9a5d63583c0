"""Deleting backends while a health round or discovery holds one: no deadlock.

A health round locks a backend's row and then updates its models; Django
deletes a backend's models before the backend. Before the deletes locked the
backend rows first, the two deadlocked on PostgreSQL and the admin's "Remove
demo backends" answered 503 (a fresh clone's failure in tests/test_nexus_run.py).
Here the round's side holds the backend's lock until the delete is seen
waiting, then updates the models, as the round does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from django.db import connection, connections, transaction

from backends.models import Backend, BackendModel
from tests.conftest import wait_until
from tests.factories import BackendFactory, BackendModelFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _another_session_waits_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        # Statistics are read once per transaction unless cleared.
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database() AND pid <> pg_backend_pid()"
        )
        row = cursor.fetchone()
    return bool(row and row[0])


def _race(delete: Callable[[], object]) -> None:
    """Hold the backend's lock as a health round does while `delete` runs."""
    backend = BackendFactory(name="demo-alpha", is_demo=True)
    BackendModelFactory(backend=backend, name="llama3:8b")
    failures: list[BaseException] = []

    def deleting() -> None:
        try:
            delete()
        except Exception as error:  # noqa: BLE001 - reported below
            failures.append(error)
        finally:
            connections.close_all()

    with transaction.atomic():
        list(Backend.objects.select_for_update().filter(pk=backend.pk))
        thread = threading.Thread(target=deleting)
        thread.start()
        wait_until(_another_session_waits_on_a_lock, timeout=10)
        # The round goes on to its models (the update that used to deadlock).
        BackendModel.objects.filter(backend=backend).update(loaded=True)
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert failures == []
    assert not Backend.objects.filter(name="demo-alpha").exists()
    assert not BackendModel.objects.filter(name="llama3:8b").exists()


@pytest.fixture(autouse=True)
def _postgresql_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SQLite locks the whole database: no row locks to order")


def test_removing_demo_backends_waits_for_the_round_instead_of_deadlocking() -> None:
    _race(lambda: Backend.objects.filter(is_demo=True).remove_demo())


def test_deleting_one_backend_waits_for_the_round_instead_of_deadlocking() -> None:
    _race(lambda: Backend.objects.get(name="demo-alpha").delete())
