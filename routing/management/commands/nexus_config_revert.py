"""Revert the configuration to a version of its history."""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import CommandError, CommandParser

from nexus_lib.commands import DatabaseCommand
from routing.config_file import ConfigError
from routing.history.diff import describe_change
from routing.history.revert import RevertResult, VersionNotFound, revert_to


class Command(DatabaseCommand):
    help = (
        "Make the configuration what it was at version N of its history "
        "(nexus_config_history lists them), through the same checks as "
        "nexus_import_config, all at once or not at all; the result is recorded "
        "as a new version. Backends' API keys are never kept in the history: "
        "each backend keeps the key it has."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("version", type=int, help="The version to revert to.")
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Show what would change, but save nothing.",
        )
        parser.add_argument(
            "--json",
            dest="as_json",
            action="store_true",
            help='Print the result, or the problems ({"ok": false, ...}, exit '
            "status 1), as JSON.",
        )

    def handle(
        self, *args: Any, version: int, dry_run: bool, as_json: bool, **options: Any
    ) -> None:
        try:
            result = revert_to(version, dry_run=dry_run)
        except (VersionNotFound, ConfigError) as error:
            if as_json:
                problems = getattr(error, "problems", [str(error)])
                self.stdout.write(
                    json.dumps({"ok": False, "problems": problems}, indent=2)
                )
                sys.exit(1)
            if isinstance(error, ConfigError):
                raise CommandError(error.describe()) from None
            raise CommandError(str(error)) from None
        if as_json:
            self.stdout.write(
                json.dumps(
                    {
                        "ok": True,
                        "reverted_to": result.target,
                        "version": result.version,
                        "dry_run": result.dry_run,
                        "changes": result.changes,
                        "warnings": result.warnings,
                    },
                    indent=2,
                )
            )
            return
        self._print(result)

    def _print(self, result: RevertResult) -> None:
        if not result.changes:
            self.stdout.write(
                f"The configuration already matches version {result.target}."
            )
        elif result.dry_run:
            self.stdout.write(
                f"Reverting to version {result.target} would change (dry run, "
                "nothing was saved):"
            )
        else:
            self.stdout.write(
                f"Reverted to version {result.target}, recorded as version "
                f"{result.version}:"
            )
        for change in result.changes:
            self.stdout.write(f"  {describe_change(change)}")
        for warning in result.warnings:
            self.stderr.write(f"Warning: {warning}")
