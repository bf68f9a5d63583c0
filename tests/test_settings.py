from __future__ import annotations

import ipaddress
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from tests import zygote

pytestmark = pytest.mark.mode_independent

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
    return zygote.run(
        [sys.executable, "-c", f"import django; django.setup(); {code}"],
        cwd=REPO_ROOT,
        env=clean,
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


# --- values read from the environment, checked as they are read -----------------

SETTINGS_FILE = REPO_ROOT / "nexus_site" / "settings.py"


def _load_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **variables: str
) -> dict[str, Any]:
    """Evaluate the settings file afresh under these variables (embedded mode)."""
    for name in ("DATABASE_URL", "REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NEXUS_STATE_DIR", str(tmp_path))
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(SETTINGS_FILE))


def _numeric_nexus_settings(values: dict[str, Any]) -> list[str]:
    return [
        name
        for name, value in values.items()
        if name.startswith("NEXUS_")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    ]


def test_new_gateway_settings_have_their_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values = _load_settings(monkeypatch, tmp_path)

    assert values["NEXUS_WORKERS"] == min(os.cpu_count() or 1, 256)
    assert values["NEXUS_SERVER"] == "daphne"
    assert values["NEXUS_ACCESS_LOG"] is True
    assert values["NEXUS_DRAIN_SECONDS"] == 30.0
    assert values["NEXUS_USAGE_BUFFER_MAX"] == 100_000
    assert values["NEXUS_USAGE_TRANSPORT"] == "database"  # no REDIS_URL
    assert values["NEXUS_METRICS_TOKEN"] == ""
    allowed = values["NEXUS_METRICS_ALLOW"]
    assert ipaddress.ip_address("127.0.0.1") in allowed[0]
    assert any(ipaddress.ip_address("::1") in net for net in allowed)
    # Loopback only: a private network is opened by the operator, not by default.
    assert not any(ipaddress.ip_address("192.168.1.20") in net for net in allowed)
    assert not any(ipaddress.ip_address("8.8.8.8") in net for net in allowed)
    assert values["NEXUS_METRICS_PER_KEY"] is False


def test_new_gateway_settings_are_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values = _load_settings(
        monkeypatch,
        tmp_path,
        NEXUS_WORKERS="4",
        NEXUS_SERVER="Granian",
        NEXUS_ACCESS_LOG="false",
        NEXUS_DRAIN_SECONDS="2.5",
        NEXUS_METRICS_ALLOW="203.0.113.0/24",
        NEXUS_METRICS_TOKEN="scrape-me",
        NEXUS_USAGE_TRANSPORT="database",
        NEXUS_ROUTING_STRATEGY=" random ",
        NEXUS_ROUTING_MAX_RETRIES="0",
    )

    assert values["NEXUS_WORKERS"] == 4
    assert values["NEXUS_SERVER"] == "granian"
    assert values["NEXUS_ACCESS_LOG"] is False
    assert values["NEXUS_DRAIN_SECONDS"] == 2.5
    assert values["NEXUS_METRICS_ALLOW"] == (ipaddress.ip_network("203.0.113.0/24"),)
    assert values["NEXUS_METRICS_TOKEN"] == "scrape-me"
    assert values["NEXUS_ROUTING_STRATEGY"] == "random"
    assert values["NEXUS_ROUTING_MAX_RETRIES"] == 0


def test_usage_goes_through_redis_when_there_is_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("NEXUS_STATE_DIR", str(tmp_path))

    values = runpy.run_path(str(SETTINGS_FILE))

    assert values["NEXUS_USAGE_TRANSPORT"] == "redis"


def test_empty_variables_mean_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values = _load_settings(
        monkeypatch,
        tmp_path,
        NEXUS_PORT="",
        NEXUS_ROUTING_MAX_RETRIES=" ",
        NEXUS_HEALTH_INTERVAL="",
    )

    assert values["NEXUS_PORT"] == 8000
    assert values["NEXUS_ROUTING_MAX_RETRIES"] is None
    assert values["NEXUS_HEALTH_INTERVAL"] == 10.0


def test_every_numeric_setting_is_range_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    names = _numeric_nexus_settings(_load_settings(monkeypatch, tmp_path))
    names.append("NEXUS_ROUTING_MAX_RETRIES")  # None (unset) by default
    assert len(names) >= 25

    for name in names:
        with pytest.raises(ImproperlyConfigured, match=f"^{name} must be"):
            _load_settings(monkeypatch, tmp_path, **{name: "-1e99"})
        monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("NEXUS_WORKERS", "0", "NEXUS_WORKERS must be a whole number from 1 to 256"),
        ("NEXUS_WORKERS", "257", "NEXUS_WORKERS must be a whole number from 1 to 256"),
        ("NEXUS_WORKERS", "two", "not 'two'"),
        ("NEXUS_PORT", "8000.5", "NEXUS_PORT must be a whole number"),
        ("NEXUS_DRAIN_SECONDS", "3601", "NEXUS_DRAIN_SECONDS must be a number from 0"),
        ("NEXUS_DRAIN_SECONDS", "nan", "NEXUS_DRAIN_SECONDS must be a number"),
        ("NEXUS_USAGE_BUFFER_MAX", "999", "from 1000 to 10000000"),
        ("NEXUS_HEALTH_LATENCY_ALPHA", "1.5", "NEXUS_HEALTH_LATENCY_ALPHA must be"),
        ("NEXUS_ROUTING_MAX_RETRIES", "11", "from 0 to 10"),
        ("NEXUS_SERVER", "gunicorn", "NEXUS_SERVER must be one of daphne, uvicorn"),
        ("NEXUS_ROLE", "admin", "NEXUS_ROLE must be one of all, gateway, control"),
        ("NEXUS_METRICS_ALLOW", "10.0.0.0/33", "NEXUS_METRICS_ALLOW must list CIDR"),
        ("NEXUS_METRICS_ALLOW", "127.0.0.0/8,localhost", "NEXUS_METRICS_ALLOW"),
        ("NEXUS_USAGE_TRANSPORT", "kafka", "NEXUS_USAGE_TRANSPORT must be one of"),
        ("NEXUS_USAGE_TRANSPORT", "redis", "NEXUS_USAGE_TRANSPORT=redis needs REDIS"),
    ],
)
def test_bad_values_stop_startup_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    name: str,
    value: str,
    message: str,
) -> None:
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        _load_settings(monkeypatch, tmp_path, **{name: value})


def test_a_bad_value_stops_manage_py_with_the_variable_named(tmp_path: Path) -> None:
    result = _run_settings(
        {"NEXUS_STATE_DIR": str(tmp_path), "NEXUS_BREAKER_WINDOW": "0"}, "pass"
    )

    assert result.returncode != 0
    assert "NEXUS_BREAKER_WINDOW must be a number from 0.1 to 86400, not '0'" in (
        result.stderr
    )


def test_database_connection_age_is_range_checked_in_production(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    monkeypatch.setenv("SECRET_KEY", "x" * 50)
    monkeypatch.setenv("ALLOWED_HOSTS", "nexus.example.com")
    monkeypatch.setenv("NEXUS_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("DB_CONN_MAX_AGE", "-5")

    with pytest.raises(ImproperlyConfigured, match="^DB_CONN_MAX_AGE must be"):
        runpy.run_path(str(SETTINGS_FILE))


def test_env_example_lists_every_variable_the_settings_read() -> None:
    source = SETTINGS_FILE.read_text(encoding="utf-8")
    read = set(
        re.findall(r'(?:env\.\w+|_bounded_\w+|_choice|_networks)\(\s*"(\w+)"', source)
    )
    read |= set(re.findall(r'"(\w+)" in env', source))
    example = (REPO_ROOT / ".env.example").read_text(encoding="utf-8")
    listed = set(re.findall(r"^(\w+)=", example, flags=re.MULTILINE))

    assert len(read) > 40
    assert read - listed == set()


# --- behind a TLS-terminating proxy ----------------------------------------------


def _check_deploy(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NEXUS_", "SECURE_")) and k not in {"DEBUG", "REDIS_URL"}
    }
    env |= {
        "NEXUS_STATE_DIR": str(tmp_path),
        "DATABASE_URL": "postgres://nexus@127.0.0.1:5432/nexus",
        "SECRET_KEY": "k7$Vq!x2Lr9#pZ4mW8tY6nB1cE3gH5jK0sD-aF_uI+oP=zXcV-tests-only-Qe",
        "ALLOWED_HOSTS": "nexus.example.com",
        **extra,
    }
    return zygote.run(
        [sys.executable, "manage.py", "check", "--deploy"],
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
    )


def test_check_deploy_is_clean_behind_tls(tmp_path: Path) -> None:
    result = _check_deploy(tmp_path, NEXUS_BEHIND_TLS="true")

    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout + result.stderr


def test_check_deploy_names_what_is_missing_without_the_switch(tmp_path: Path) -> None:
    result = _check_deploy(tmp_path)

    found = set(re.findall(r"security\.W\d+", result.stdout + result.stderr))
    # HSTS, HTTPS redirect, secure session and CSRF cookies.
    assert found == {"security.W004", "security.W008", "security.W012", "security.W016"}


def test_the_proxy_header_and_hsts_are_read_from_the_environment(
    tmp_path: Path,
) -> None:
    result = _run_settings(
        {
            "NEXUS_STATE_DIR": str(tmp_path),
            "NEXUS_BEHIND_TLS": "true",
            "NEXUS_TLS_PROXY_HEADER": "X-Forwarded-Scheme",
            "NEXUS_HSTS_SECONDS": "600",
            "NEXUS_HSTS_PRELOAD": "true",
        },
        "from django.conf import settings as s; print(s.SECURE_PROXY_SSL_HEADER, "
        "s.SECURE_HSTS_SECONDS, s.SECURE_HSTS_PRELOAD, s.SILENCED_SYSTEM_CHECKS)",
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "('HTTP_X_FORWARDED_SCHEME', 'https') 600 True []"


def test_a_copied_env_example_keeps_the_embedded_default(tmp_path: Path) -> None:
    """Issue 12, item 10: .env.example as it comes switches nothing on."""
    example = (REPO_ROOT / ".env.example").read_text(encoding="utf-8")
    values = dict(re.findall(r"^(\w+)=(.*)$", example, flags=re.MULTILINE))
    values["NEXUS_STATE_DIR"] = str(tmp_path)
    result = _run_settings(
        values,
        "from django.conf import settings; "
        "print(settings.NEXUS_PRODUCTION, settings.DATABASES['default']['ENGINE'], "
        "settings.REDIS_URL == '', settings.ALLOWED_HOSTS)",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split(" ", 2) == [
        "False",
        "django.db.backends.sqlite3",
        "True ['127.0.0.1', 'localhost', '[::1]']\n",
    ]
