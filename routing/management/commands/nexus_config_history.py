"""List the versions of the configuration history, or show one."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandError, CommandParser

from nexus_lib.commands import DatabaseCommand
from routing.history.diff import describe_change, summarize_version
from routing.models import ConfigRevision


class Command(DatabaseCommand):
    help = (
        "List the newest versions of the configuration history (who changed "
        "what, when), or with --show N every change of version N. Revert to one "
        "with nexus_config_revert N."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--limit", type=int, default=20, help="Versions to list (default 20)."
        )
        parser.add_argument("--show", type=int, metavar="N", help="Show version N.")
        parser.add_argument(
            "--json", dest="as_json", action="store_true", help="Print JSON."
        )

    def handle(
        self, *args: Any, limit: int, show: int | None, as_json: bool, **options: Any
    ) -> None:
        if limit < 1:
            raise CommandError("--limit must be at least 1.")
        versions = ConfigRevision.objects.defer("snapshot", "secret_marks")
        if show is not None:
            versions = versions.filter(number=show)
            if not versions.exists():
                raise CommandError(f"The configuration history has no version {show}.")
        rows = list(versions.order_by("-number")[:limit])
        if as_json:
            self.stdout.write(json.dumps([_as_dict(row) for row in rows], indent=2))
            return
        for row in rows:
            when = row.created_at.strftime("%Y-%m-%d %H:%M:%S")
            line = f"{row.number:>6}  {when}  {row.author} ({row.via})"
            if show is None:
                self.stdout.write(
                    f"{line}  {summarize_version(row.diff, row.reverted_to)}"
                )
                continue
            self.stdout.write(line)
            for change in row.diff:
                self.stdout.write(f"  {describe_change(change)}")


def _as_dict(row: ConfigRevision) -> dict[str, Any]:
    return {
        "version": row.number,
        "created": row.created_at.isoformat(),
        "author": row.author,
        "via": row.via,
        "reverted_to": row.reverted_to,
        "diff": row.diff,
    }
