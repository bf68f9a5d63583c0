"""Export the routing configuration as a TOML file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import CommandError, CommandParser

from nexus_lib.commands import DatabaseCommand
from routing.config_file import export_config


class Command(DatabaseCommand):
    help = (
        "Write backends, their models, aliases, fallback chains and the routing "
        "policy as a TOML file that nexus_import_config reads back unchanged. "
        "API keys are never written, and demo backends (managed by nexus_run) "
        "are left out. Writes to standard output without PATH."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "path", nargs="?", default="-", help="Output file (default: stdout)."
        )

    def handle(self, *args: Any, path: str, **options: Any) -> None:
        text = export_config()
        if path == "-":
            self.stdout.write(text, ending="")
            return
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as error:
            raise CommandError(
                f"{path}: cannot write the file: {error.strerror}"
            ) from None
        self.stdout.write(f"Wrote the configuration to {path}.")
