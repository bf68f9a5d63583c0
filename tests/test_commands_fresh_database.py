"""``nexus_*`` commands on a database nothing has migrated yet.

A new user's first command is not always ``make run``: ``nexus_import_config``
or ``nexus_create_key`` on a fresh state directory died with a traceback ("no
such table"). The embedded default's private SQLite file is now migrated
there and then; a production database, shared with running gateways, is left
alone with a message saying how to migrate it.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from tests import zygote

REPO_ROOT = Path(__file__).resolve().parent.parent


def _embedded_env(state: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS"):
        env.pop(name, None)
    env["NEXUS_STATE_DIR"] = str(state)
    return env


@pytest.mark.mode_independent
def test_a_first_command_on_a_fresh_state_directory_prepares_it(tmp_path: Path) -> None:
    env = _embedded_env(tmp_path / "state")
    first = zygote.run(
        [sys.executable, "manage.py", "nexus_create_key", "first", "--json"],
        cwd=REPO_ROOT,
        env=env,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "Preparing the database" in first.stderr
    assert json.loads(first.stdout)["key"].startswith("nx-")
    assert "Traceback" not in first.stderr

    again = zygote.run(
        [sys.executable, "manage.py", "nexus_usage", "--json"],
        cwd=REPO_ROOT,
        env=env,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Preparing" not in again.stderr  # migrated once


@pytest.mark.skipif(
    not settings.NEXUS_PRODUCTION, reason="a shared PostgreSQL database"
)
@pytest.mark.django_db
def test_a_production_database_is_not_migrated_behind_the_operators_back() -> None:
    db = connection.settings_dict
    host, port, user = db["HOST"] or "127.0.0.1", db["PORT"] or 5432, db["USER"]
    name = f"nexus_unmigrated_{uuid.uuid4().hex[:10]}"
    admin = f"host={host} port={port} user={user} dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as server:
        server.execute(f'CREATE DATABASE "{name}"')
    try:
        env = dict(os.environ)
        env["DATABASE_URL"] = f"postgres://{user}@{host}:{port}/{name}"
        result = zygote.run(
            [sys.executable, "manage.py", "nexus_usage"],
            cwd=REPO_ROOT,
            env=env,
            timeout=120,
        )
        assert result.returncode == 1, result.stdout + result.stderr
        assert "python manage.py migrate" in result.stderr
        assert "Traceback" not in result.stderr
        with psycopg.connect(
            f"host={host} port={port} user={user} dbname={name}"
        ) as fresh:
            tables = fresh.execute(
                "SELECT count(*) FROM information_schema.tables "
                "WHERE table_schema = 'public'"
            ).fetchone()
        assert tables == (0,)  # nothing was changed
    finally:
        with psycopg.connect(admin, autocommit=True) as server:
            server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
