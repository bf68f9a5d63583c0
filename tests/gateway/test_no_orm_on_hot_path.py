"""No ORM on the hot path: the proxy's modules load no django.db and no models.

import-linter keeps gateway.proxy and gateway.protocols from importing a
models module directly (pyproject.toml); this checks what importing every one
of them really loads, transitively, in a fresh interpreter with no Django
settings, including Django's own django.db, which import-linter cannot name.
(tests/gateway/test_proxy_hot_path.py checks that a served request makes no
query.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

HOT_PATH = ("gateway.proxy", "gateway.protocols", "gateway.exchange")
PROJECT = ("nexus_site", "gateway", "routing", "usage", "backends", "nexus_lib")

_IMPORT_ALL = """
import importlib, json, pkgutil, sys
names = []
for root in {roots!r}:
    package = importlib.import_module(root)
    names.append(root)
    for info in pkgutil.walk_packages(getattr(package, "__path__", ()), root + "."):
        importlib.import_module(info.name)
        names.append(info.name)
print(json.dumps({{"imported": names, "loaded": sorted(sys.modules)}}))
"""


_SETUP_AND_IMPORT_SNAPSHOT = """
import django, json, sys
django.setup()
import routing.snapshot
print(json.dumps(sorted(sys.modules)))
"""


def _load(roots: tuple[str, ...]) -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL.format(roots=roots)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _orm_modules(loaded: list[str]) -> list[str]:
    return [
        name
        for name in loaded
        if name == "django.db"
        or name.startswith("django.db.")
        or (name.split(".")[0] in PROJECT and name.split(".")[-1] == "models")
    ]


@pytest.mark.mode_independent
def test_the_proxy_and_the_translators_load_no_orm_module() -> None:
    result = _load(HOT_PATH)
    imported = set(result["imported"])
    assert {"gateway.proxy.dispatch", "gateway.proxy.forward", "gateway.exchange"} <= (
        imported
    )
    assert _orm_modules(result["loaded"]) == []


@pytest.mark.mode_independent
def test_the_check_sees_the_orm_where_it_is_loaded() -> None:
    # The configuration app's snapshot builder does load the ORM, and the
    # same filter finds it: the check above cannot pass for want of looking.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _SETUP_AND_IMPORT_SNAPSHOT,
        ],
        cwd=REPO_ROOT,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = _orm_modules(json.loads(done.stdout))
    assert "django.db.models" in found and "routing.models" in found
