"""Write this process's usage buffer and roll pending usage up now."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from usage.flush import flush_usage
from usage.models import UsageRecord
from usage.rollup import roll_up_usage


class Command(BaseCommand):
    help = (
        "Flush buffered usage events and roll every pending usage record up into "
        "the totals and per-minute buckets now, instead of waiting for the "
        "periodic task."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            flushed = flush_usage()
            rolled_up = roll_up_usage()
            pending = UsageRecord.objects.pending().count()
        except DatabaseError as error:
            raise CommandError(f"Could not reach the usage tables: {error}") from error
        if options["json"]:
            result = {"flushed": flushed, "rolled_up": rolled_up, "pending": pending}
            self.stdout.write(json.dumps(result))
            return
        self.stdout.write(
            f"Flushed {flushed} buffered usage event{'s' * (flushed != 1)} "
            f"(serving processes flush their own about once a second)."
        )
        self.stdout.write(
            f"Rolled up {rolled_up} usage record{'s' * (rolled_up != 1)}; "
            f"{pending} pending."
        )
