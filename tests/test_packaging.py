"""What ships: every package of the product is installed and in the image."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.conftest import REPO_ROOT


def _packages() -> list[str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in patterns]


@pytest.mark.mode_independent
def test_every_top_level_package_of_the_repo_is_installed() -> None:
    found = {
        path.parent.name
        for path in REPO_ROOT.glob("*/__init__.py")
        if path.parent.name != "tests"
    }
    assert found == set(_packages())


@pytest.mark.mode_independent
def test_the_image_copies_every_installed_package() -> None:
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \./\1$", dockerfile, re.MULTILINE))
    assert set(_packages()) <= copied
