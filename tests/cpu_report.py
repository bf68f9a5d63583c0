"""Opt-in pytest plugin: CPU per test file, to find what makes the suite slow.

``make test PYTEST_ARGS="-p tests.cpu_report"`` appends one JSON line per test
file and mode to ``$NEXUS_CPU_REPORT`` (default ``cpu-report.jsonl``): the test
worker's own CPU seconds, the CPU of the child processes it waited for
(``subprocess`` children; servers forked by tests/zygote.py are the
forkserver's children and are not counted), and wall seconds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

_totals: dict[str, list[float]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    cpu, wall, before = time.process_time(), time.monotonic(), os.times()
    try:
        return (yield)
    finally:
        after = os.times()
        totals = _totals.setdefault(item.nodeid.split("::")[0], [0.0, 0.0, 0.0])
        totals[0] += time.process_time() - cpu
        totals[1] += (after.children_user + after.children_system) - (
            before.children_user + before.children_system
        )
        totals[2] += time.monotonic() - wall


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("NEXUS_CPU_REPORT", "cpu-report.jsonl")
    mode = os.environ.get("NEXUS_TEST_MODE", "embedded")
    with open(path, "a", encoding="utf-8") as report:
        for name, (own, children, wall) in sorted(_totals.items()):
            line = {"file": name, "mode": mode, "cpu_s": round(own, 2)}
            line |= {"children_cpu_s": round(children, 2), "wall_s": round(wall, 1)}
            report.write(json.dumps(line) + "\n")
