"""Probe backends now and print their health (the beat task's round, on demand)."""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from backends.health import check_all
from backends.models import Backend, HealthStatus


class Command(BaseCommand):
    help = (
        "Run a health round now: probe every enabled backend (or --backend NAME, "
        "even a disabled one) concurrently, record the results as the scheduled "
        "checks do, and print name, kind, status, latency, models and error. Exits "
        "with status 1 when a checked backend is unhealthy or still unknown."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--backend", metavar="NAME", help="Check only this backend."
        )
        parser.add_argument(
            "--json", action="store_true", help="Print the reports as JSON."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["backend"]
        if name is not None:
            backend = Backend.objects.filter(name=name).first()
            if backend is None:
                known = ", ".join(Backend.objects.values_list("name", flat=True))
                raise CommandError(
                    f"No backend named {name!r}. Known backends: {known or 'none'}."
                )
            reports = check_all([backend.pk], include_disabled=True)
        else:
            reports = check_all()
        if options["json"]:
            self.stdout.write(json.dumps([r.as_dict() for r in reports], indent=2))
        elif not reports:
            self.stdout.write("No enabled backends to check.")
        else:
            rows = [
                (
                    r.name,
                    r.kind,
                    r.status,
                    "-" if r.latency_ms is None else f"{r.latency_ms:,.0f} ms",
                    str(r.models),
                    r.error,
                )
                for r in reports
            ]
            header = ("NAME", "KIND", "STATUS", "LATENCY", "MODELS", "ERROR")
            widths = [max(len(row[i]) for row in (header, *rows)) for i in range(5)]
            for row in (header, *rows):
                cells = [
                    cell.ljust(width)
                    for cell, width in zip(row[:5], widths, strict=True)
                ]
                self.stdout.write("  ".join([*cells, row[5]]).rstrip())
        failing = [
            r.name
            for r in reports
            if r.status in (HealthStatus.UNHEALTHY, HealthStatus.UNKNOWN)
        ]
        if failing:
            self.stderr.write(f"Not healthy: {', '.join(failing)}")
            sys.exit(1)
