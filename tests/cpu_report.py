"""Opt-in pytest plugin: CPU per test file, to find what makes the suite slow.

``make test PYTEST_ARGS="-p tests.cpu_report"`` appends one JSON line per test
file and mode to ``$NEXUS_CPU_REPORT`` (default ``cpu-report.jsonl``): the test
worker's own CPU seconds, the CPU of the child processes it waited for
(``subprocess`` children), the CPU of the servers forked by tests/zygote.py
(the forkserver's children, which no ``os.times()`` of the worker counts:
sampled from ``/proc`` every 0.2 s while they live, so a server's last 0.2 s
before it exits can be missed) with how many were started, and wall seconds.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests import zygote

_totals: dict[str, list[float]] = {}
_TICK = os.sysconf("SC_CLK_TCK")


class _ForkedCpu:
    """The last CPU seconds seen of each forked server, by test file."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.alive: dict[int, tuple[str, float]] = {}  # pid: (file, cpu seen)
        self.done: dict[str, list[float]] = {}  # file: [cpu, servers started]
        self.file = ""
        threading.Thread(target=self._sample, daemon=True).start()

    def started(self, process: zygote.ForkedProcess) -> None:
        with self.lock:
            self.alive[process.pid] = (self.file, 0.0)
            self.done.setdefault(self.file, [0.0, 0])[1] += 1

    def _sample(self) -> None:
        while True:
            time.sleep(0.2)
            with self.lock:
                for pid, (name, seen) in list(self.alive.items()):
                    cpu = _cpu_of(pid)
                    if cpu is None:
                        del self.alive[pid]
                        self.done.setdefault(name, [0.0, 0])[0] += seen
                    else:
                        self.alive[pid] = (name, cpu)

    def of(self, name: str) -> tuple[float, int]:
        with self.lock:
            cpu, count = self.done.get(name, [0.0, 0])
            cpu += sum(seen for file, seen in self.alive.values() if file == name)
        return cpu, int(count)


def _cpu_of(pid: int) -> float | None:
    """utime + stime + its waited-for children's, in seconds (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return sum(int(n) for n in fields[11:15]) / _TICK


_forked = _ForkedCpu()
zygote.ON_START.append(_forked.started)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    _forked.file = item.nodeid.split("::")[0]
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
            forked, started = _forked.of(name)
            line |= {"forked_cpu_s": round(forked, 2), "forked": started}
            report.write(json.dumps(line) + "\n")
