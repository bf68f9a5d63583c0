"""CPU use during a measurement: per process tree, and of the whole machine."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.bench.processes import ProcessGroup


@dataclass
class CpuUsage:
    """Filled in when the measurement ends."""

    percent: dict[str, float] = field(default_factory=dict)  # of one CPU, per group
    server_by_process: dict[str, float] = field(default_factory=dict)  # pid: %
    # Busy share of all the machine's CPUs, whoever used them: near 100 %, the
    # targets competed with the clients, the mock and other work for CPU time.
    machine_busy: float = 0.0


@contextlib.contextmanager
def measure_cpu(watched: dict[str, ProcessGroup]) -> Iterator[CpuUsage]:
    """Measure each watched group's CPU use, summed over its process tree."""
    usage = CpuUsage()
    before = {name: group.cpu_seconds_by_process() for name, group in watched.items()}
    busy_before, all_before = _machine_ticks()
    began = time.monotonic()
    yield usage
    wall = max(time.monotonic() - began, 1e-9)
    busy_after, all_after = _machine_ticks()
    for name, group in watched.items():
        after = group.cpu_seconds_by_process()
        shares = {
            pid: (seconds - before[name].get(pid, 0.0)) / wall * 100
            for pid, seconds in after.items()
        }
        usage.percent[name] = round(sum(shares.values()), 1)
        if name == "server":
            usage.server_by_process = {
                str(pid): round(share, 1) for pid, share in shares.items()
            }
    elapsed = max(all_after - all_before, 1)
    usage.machine_busy = round((busy_after - busy_before) / elapsed * 100, 1)


def _machine_ticks() -> tuple[int, int]:
    """Busy and total CPU ticks of the machine so far (/proc/stat's cpu line)."""
    with contextlib.suppress(OSError):
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(value) for value in fields[:8]]
        idle = ticks[3] + ticks[4]  # idle and iowait
        return sum(ticks) - idle, sum(ticks)
    return 0, 1


def cpu_cost(cpu: dict[str, float], rate: float) -> dict[str, float | None]:
    """Return each process group's CPU time per request, in ms.

    Unlike rates and latencies, this hardly changes when other processes compete
    for the CPUs, so it still compares runs on a busy machine.
    """
    return {
        name: round(percent / 100 / rate * 1000, 3) if rate else None
        for name, percent in cpu.items()
    }
