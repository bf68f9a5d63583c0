from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _run_settings(env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {
            "SECRET_KEY",
            "DATABASE_URL",
            "REDIS_URL",
            "ALLOWED_HOSTS",
            "NEXUS_STATE_DIR",
            "DEBUG",
        }
    }
    clean.update(env)
    clean["DJANGO_SETTINGS_MODULE"] = "nexus_site.settings"
    return subprocess.run(
        [sys.executable, "-c", f"import django; django.setup(); {code}"],
        cwd=REPO_ROOT,
        env=clean,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_embedded_mode_generates_and_keeps_a_secret_key(tmp_path: Path) -> None:
    code = "from django.conf import settings; print(settings.SECRET_KEY)"
    first = _run_settings({"NEXUS_STATE_DIR": str(tmp_path)}, code)
    second = _run_settings({"NEXUS_STATE_DIR": str(tmp_path)}, code)
    assert first.returncode == 0, first.stderr
    key = first.stdout.strip()
    assert len(key) >= 50
    assert second.stdout.strip() == key
    assert (tmp_path / "secret_key").stat().st_mode & 0o077 == 0


def test_embedded_mode_uses_sqlite_and_no_servers(tmp_path: Path) -> None:
    code = (
        "from django.conf import settings as s; "
        "print(s.DATABASES['default']['ENGINE'], "
        "s.CHANNEL_LAYERS['default']['BACKEND'], s.CELERY_BROKER_URL, s.DEBUG)"
    )
    result = _run_settings({"NEXUS_STATE_DIR": str(tmp_path)}, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "django.db.backends.sqlite3",
        "channels.layers.InMemoryChannelLayer",
        "filesystem://localhost//",
        "False",
    ]


@pytest.mark.parametrize("missing", ["SECRET_KEY", "ALLOWED_HOSTS"])
def test_production_mode_refuses_to_start_without_required_settings(
    tmp_path: Path, missing: str
) -> None:
    env = {
        "NEXUS_STATE_DIR": str(tmp_path),
        "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/test",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "SECRET_KEY": "x" * 50,
        "ALLOWED_HOSTS": "nexus.example.com",
    }
    del env[missing]
    result = _run_settings(env, "pass")
    assert result.returncode != 0
    assert f"{missing} must be set" in result.stderr


def test_production_mode_uses_postgres_and_redis(tmp_path: Path) -> None:
    env = {
        "NEXUS_STATE_DIR": str(tmp_path),
        "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/test",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "SECRET_KEY": "x" * 50,
        "ALLOWED_HOSTS": "nexus.example.com",
    }
    code = (
        "from django.conf import settings as s; "
        "print(s.DATABASES['default']['ENGINE'], "
        "s.CHANNEL_LAYERS['default']['BACKEND'], s.CELERY_BROKER_URL)"
    )
    result = _run_settings(env, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "django.db.backends.postgresql",
        "channels_redis.core.RedisChannelLayer",
        "redis://127.0.0.1:6379/0",
    ]
