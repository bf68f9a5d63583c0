"""List what each backend serves and update its models (the beat task, on demand)."""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from backends.discovery import discover_models
from backends.models import Backend


class Command(BaseCommand):
    help = (
        "Ask every enabled backend (or --backend NAME, even a disabled one) which "
        "models it serves, and add, update, disable or re-enable their rows. "
        "Fields set by hand in the admin are kept. Exits with status 1 when a "
        "backend could not be listed."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--backend", metavar="NAME", help="Discover only this backend's models."
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
            reports = discover_models([backend.pk], include_disabled=True)
        else:
            reports = discover_models()
        if options["json"]:
            self.stdout.write(json.dumps([r.as_dict() for r in reports], indent=2))
        elif not reports:
            self.stdout.write("No enabled backends to ask.")
        else:
            width = max(len(r.name) for r in reports)
            for report in reports:
                self.stdout.write(f"{report.name.ljust(width)}  {report.summary()}")
        failed = [r.name for r in reports if not r.ok]
        if failed:
            self.stderr.write(f"Could not list: {', '.join(failed)}")
            sys.exit(1)
