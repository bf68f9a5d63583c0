"""Write the usage waiting in Redis and roll pending usage up now."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError
from redis.exceptions import RedisError

from nexus_lib.commands import DatabaseCommand
from usage.models import UsageRecord
from usage.rollup import roll_up_usage
from usage.stream import drain_usage_stream


class Command(DatabaseCommand):
    help = (
        "Write the usage events serving processes shipped to Redis (production) "
        "and roll every pending usage record up into the totals and per-minute "
        "buckets now, instead of waiting for the periodic tasks."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            moved = (
                drain_usage_stream() if settings.NEXUS_USAGE_TRANSPORT == "redis" else 0
            )
            rolled_up = roll_up_usage()
            pending = UsageRecord.objects.pending().count()
        except (DatabaseError, RedisError) as error:
            raise CommandError(f"Could not reach the usage store: {error}") from error
        if options["json"]:
            result = {"flushed": moved, "rolled_up": rolled_up, "pending": pending}
            self.stdout.write(json.dumps(result))
            return
        if settings.NEXUS_USAGE_TRANSPORT == "redis":
            self.stdout.write(
                f"Wrote {moved} usage event{'s' * (moved != 1)} from Redis "
                "(the Celery worker does this about once a second)."
            )
        else:
            self.stdout.write(
                "Serving processes write their own usage about once a second."
            )
        self.stdout.write(
            f"Rolled up {rolled_up} usage record{'s' * (rolled_up != 1)}; "
            f"{pending} pending."
        )
