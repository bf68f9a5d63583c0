"""``nexus_process_restarts_total``: how often the launcher restarted a process.

``nexus_run`` restarts a serving process, the Celery worker or beat when it
dies, and keeps the counts in a small JSON file whose path it gives its
children (``NEXUS_RESTARTS_FILE``); whichever serving process is scraped reads
it then (a few bytes, off the request path).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

RESTARTS_FILE_ENV = "NEXUS_RESTARTS_FILE"


class RestartsCollector(Collector):
    """Reads the launcher's restart counts at each scrape."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "nexus_process_restarts",
            "Times nexus_run restarted a process that died, by process.",
            labels=("process",),
        )
        try:
            counts = json.loads(self.path.read_text())
        except (OSError, ValueError):
            counts = {}
        if isinstance(counts, dict):
            for process, count in sorted(counts.items()):
                if isinstance(count, int) and not isinstance(count, bool):
                    family.add_metric((str(process)[:64],), count)
        yield family


def restarts_collector() -> RestartsCollector | None:
    """The collector for this process's launcher, if it has one."""
    path = os.environ.get(RESTARTS_FILE_ENV)
    return RestartsCollector(Path(path)) if path else None
