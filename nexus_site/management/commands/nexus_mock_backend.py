"""Serve a fake OpenAI-compatible model server (see ``nexus_mock``).

The same flags and code as ``python -m nexus_mock``; this command
keeps the name users and scripts know.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from nexus_mock import ListenError
from nexus_mock.cli import (
    DESCRIPTION,
    UsageError,
    add_arguments,
    serve_from_options,
)


class Command(BaseCommand):
    help = DESCRIPTION
    # The mock must start fast and never touch the database.
    requires_system_checks = ()

    def add_arguments(self, parser: CommandParser) -> None:
        add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            serve_from_options(options, self._announce)
        except (UsageError, ListenError) as error:
            raise CommandError(str(error)) from None

    def _announce(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()
