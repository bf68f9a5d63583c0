"""Import the routing configuration from a TOML file."""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import CommandError, CommandParser

from nexus_lib.authorship import VIA_IMPORT, ChangeAuthor, acting_as
from nexus_lib.commands import DatabaseCommand
from routing.config_file import ConfigError, ImportSummary, import_config_file
from routing.history.recording import recording_changes


class Command(DatabaseCommand):
    help = (
        "Import backends, their models, aliases, fallback chains and the routing "
        "policy from a TOML file (- reads standard input). The whole file is "
        "checked first and applied in one transaction, so an error changes "
        "nothing. Rows are matched by name: importing the same file twice changes "
        "nothing. A key a backend or model entry leaves out takes its default; a "
        "backend without api_key or api_key_env keeps its stored key. Demo "
        "backends are managed by nexus_run and never touched."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", help="The TOML file, or - for standard input.")
        parser.add_argument(
            "--replace",
            action="store_true",
            help="Also delete the backends (except demo backends), models, aliases "
            "and fallback chains the file does not mention, and reset routing "
            "keys it leaves out to their defaults.",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Check everything and report what would change, but save nothing.",
        )
        parser.add_argument(
            "--json",
            dest="as_json",
            action="store_true",
            help="Print the summary, or the problems found, as JSON on stdout "
            '({"ok": false, "problems": [...]} with exit status 1).',
        )

    def handle(
        self,
        *args: Any,
        path: str,
        replace: bool,
        dry_run: bool,
        as_json: bool,
        **options: Any,
    ) -> None:
        try:
            with (
                acting_as(ChangeAuthor("import", VIA_IMPORT)),
                recording_changes(),
            ):
                summary = import_config_file(path, replace=replace, dry_run=dry_run)
        except ConfigError as error:
            if as_json:
                problems = {
                    "ok": False,
                    "source": error.source,
                    "problems": error.problems,
                }
                self.stdout.write(json.dumps(problems, indent=2))
                sys.exit(1)
            raise CommandError(error.describe()) from None
        if as_json:
            self.stdout.write(json.dumps({"ok": True, **summary.as_dict()}, indent=2))
        else:
            self._print_summary(path, summary)
            for warning in summary.warnings:
                self.stderr.write(f"Warning: {warning}")

    def _print_summary(self, path: str, summary: ImportSummary) -> None:
        source = "standard input" if path == "-" else path
        if summary.dry_run:
            self.stdout.write(f"Checked {source} (dry run, nothing was saved):")
        else:
            self.stdout.write(f"Imported {source}:")
        columns = ("created", "updated", "deleted", "unchanged")
        self.stdout.write(f"  {'table':<16}" + "".join(f"{c:>10}" for c in columns))
        for name, changes in summary.tables():
            counts = (getattr(changes, column) for column in columns)
            self.stdout.write(f"  {name:<16}" + "".join(f"{n:>10}" for n in counts))
        if not summary.has_changes:
            self.stdout.write("Nothing to change: the database already matches.")
