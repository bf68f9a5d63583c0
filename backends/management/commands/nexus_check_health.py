"""Probe backends now and print their health (the beat task's round, on demand)."""

from __future__ import annotations

from collections.abc import Sequence

from backends.health import CheckReport, check_all
from backends.management.rounds import BackendRoundCommand, format_columns
from backends.models import HealthStatus

HEADER = ("NAME", "KIND", "VERSION", "STATUS", "LATENCY", "MODELS", "ERROR")


class Command(BackendRoundCommand[CheckReport]):
    help = (
        "Run a health round now: probe every enabled backend (or --backend NAME, "
        "even a disabled one) concurrently, record the results as the scheduled "
        "checks do, and print name, kind, server version, status, latency, models "
        "and error. Exits "
        "with status 1 when a checked backend is unhealthy or still unknown."
    )
    backend_help = "Check only this backend."
    nothing_to_do = "No enabled backends to check."
    failure_label = "Not healthy"

    def run_round(
        self, backend_ids: list[int] | None, *, include_disabled: bool
    ) -> list[CheckReport]:
        return check_all(backend_ids, include_disabled=include_disabled)

    def format_reports(self, reports: Sequence[CheckReport]) -> list[str]:
        rows = [
            (
                r.name,
                r.kind,
                r.version or "-",
                # "unhealthy" with no error reads as a bug: say it is recovering.
                r.progress if r.progress.startswith("pending") else r.status,
                "-" if r.latency_ms is None else f"{r.latency_ms:,.0f} ms",
                str(r.models),
                r.error,
            )
            for r in reports
        ]
        return format_columns([HEADER, *rows])

    def failed(self, reports: Sequence[CheckReport]) -> list[str]:
        return [
            r.name
            for r in reports
            if r.status in (HealthStatus.UNHEALTHY, HealthStatus.UNKNOWN)
        ]
