"""The benchmark's database side: its rows, and the settings its servers share."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from urllib.parse import quote

from django.conf import settings
from django.db import connection, transaction

from backends.models import Backend, BackendModel, HealthStatus
from usage.models import ApiKey

BACKEND_NAME = "nexus-bench-mock"
MODEL = "nexus-bench-model"
KEY_NAME = "nexus-bench"


@contextlib.contextmanager
def install_bench_rows(mock_url: str) -> Iterator[str]:
    """Register the mock as a healthy backend and create a client key; clean up."""
    with transaction.atomic():
        Backend.objects.filter(name=BACKEND_NAME).delete()
        ApiKey.objects.filter(name=KEY_NAME).deactivate()
        backend = Backend.objects.create(
            name=BACKEND_NAME,
            base_url=mock_url,
            priority=0,
            status=HealthStatus.HEALTHY,
        )
        BackendModel.objects.create(backend=backend, name=MODEL, context_length=8192)
        _, raw_key = ApiKey.objects.create_key(KEY_NAME)
    try:
        yield raw_key
    finally:
        with transaction.atomic():
            Backend.objects.filter(name=BACKEND_NAME).delete()
            ApiKey.objects.filter(name=KEY_NAME).deactivate()


def child_environment() -> dict[str, str]:
    """Environment for the serving processes: this process's settings and database."""
    env = dict(os.environ)
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        env["NEXUS_SQLITE_PATH"] = str(db["NAME"])
    elif connection.vendor == "postgresql":
        auth = quote(db["USER"] or "", safe="")
        if db["PASSWORD"]:
            auth += ":" + quote(db["PASSWORD"], safe="")
        host = db["HOST"] or "127.0.0.1"
        env["DATABASE_URL"] = (
            f"postgres://{auth}@{host}:{db['PORT'] or 5432}/{quote(db['NAME'])}"
        )
    return env


def ensure_database() -> None:
    """Create the configured PostgreSQL database if it does not exist yet."""
    if connection.vendor != "postgresql":
        return
    from django.db.utils import OperationalError

    try:
        connection.ensure_connection()
    except OperationalError as error:
        if "does not exist" not in str(error):
            raise
        name = connection.settings_dict["NAME"]
        # Django's own way in (the test runner uses it to create test databases).
        with connection._nodb_cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')


def describe_settings() -> str:
    layer = str(settings.CHANNEL_LAYERS["default"]["BACKEND"]).rsplit(".", 1)[-1]
    mode = "production" if settings.NEXUS_PRODUCTION else "embedded"
    return f"{mode} ({connection.vendor}, {layer})"
