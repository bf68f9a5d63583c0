"""A pytest plugin: the test files that take longest start first.

`make test` hands whole files to pytest-xdist workers (``--dist loadfile``) in
collection order (``--no-loadscope-reorder``; xdist's own order puts files
with the most tests first, which started the one-test minute-long API fuzz
walks last and left one worker running them alone at the end). This plugin
sorts the collection by each file's wall seconds in this mode, as measured
last, longest first (Longest Processing Time first: the last file to start
is a short one). Files not measured yet come after the measured ones, in
their usual order.

The seconds live in ``tests/file_seconds.json``. To measure again::

    make test PYTEST_ARGS="-p tests.cpu_report"
    .venv/bin/python -m tests.file_order cpu-report.jsonl
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

SECONDS = Path(__file__).with_name("file_seconds.json")


def _seconds(mode: str) -> dict[str, float]:
    try:
        measured = json.loads(SECONDS.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return {name: float(value) for name, value in measured.get(mode, {}).items()}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    seconds = _seconds(os.environ.get("NEXUS_TEST_MODE", "embedded"))
    if not seconds:
        return
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))

    def key(item: pytest.Item) -> tuple[float, int]:
        name = item.nodeid.split("::")[0]
        return (-seconds.get(name, 0.0), first_seen[name])

    # A stable sort: each file's tests stay together and in their order.
    items.sort(key=key)


def write_seconds(report: Path) -> None:
    """Rewrite file_seconds.json from a cpu_report run (both modes)."""
    by_mode: dict[str, dict[str, float]] = {}
    for line in report.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        by_mode.setdefault(row["mode"], {})[row["file"]] = row["wall_s"]
    ordered = {
        mode: dict(sorted(files.items(), key=lambda entry: -entry[1]))
        for mode, files in sorted(by_mode.items())
    }
    SECONDS.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write_seconds(Path(sys.argv[1] if len(sys.argv) > 1 else "cpu-report.jsonl"))
