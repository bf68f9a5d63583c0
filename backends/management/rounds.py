"""What nexus_check_health and nexus_discover_models share.

Both run one round (health or discovery) over every enabled backend, or over
one backend named with ``--backend`` (even a disabled one), print a report per
backend as text or ``--json``, and exit with status 1 when a backend failed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from django.core.management.base import CommandError, CommandParser

from backends.models import Backend
from nexus_lib.commands import DatabaseCommand


class Report(Protocol):
    """What a round reports about one backend."""

    @property
    def name(self) -> str: ...

    def as_dict(self) -> Any: ...


R = TypeVar("R", bound=Report)


class BackendRoundCommand(DatabaseCommand, Generic[R]):
    """A command that runs a round over backends and prints one report each.

    Subclasses say what the round is (``run_round``), how its reports read
    (``format_reports``) and which backends failed (``failed``).
    """

    backend_help = "Only this backend."
    nothing_to_do = "No enabled backends."
    failure_label = "Failed"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--backend", metavar="NAME", help=self.backend_help)
        parser.add_argument(
            "--json", action="store_true", help="Print the reports as JSON."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["backend"]
        if name is None:
            reports = self.run_round(None, include_disabled=False)
        else:
            reports = self.run_round([find_backend(name).pk], include_disabled=True)
        if options["json"]:
            self.stdout.write(json.dumps([r.as_dict() for r in reports], indent=2))
        elif not reports:
            self.stdout.write(self.nothing_to_do)
        else:
            for line in self.format_reports(reports):
                self.stdout.write(line)
        failed = self.failed(reports)
        if failed:
            self.stderr.write(f"{self.failure_label}: {', '.join(failed)}")
            sys.exit(1)

    def run_round(
        self, backend_ids: list[int] | None, *, include_disabled: bool
    ) -> list[R]:
        """Run the round and return its reports in the backends' admin order."""
        raise NotImplementedError

    def format_reports(self, reports: Sequence[R]) -> list[str]:
        """Return the text lines that describe the reports."""
        raise NotImplementedError

    def failed(self, reports: Sequence[R]) -> list[str]:
        """Return the names of the backends whose round failed."""
        raise NotImplementedError


def find_backend(name: str) -> Backend:
    """Return the backend called `name`; raise CommandError naming the known ones."""
    backend = Backend.objects.filter(name=name).first()
    if backend is None:
        known = ", ".join(Backend.objects.values_list("name", flat=True))
        raise CommandError(
            f"No backend named {name!r}. Known backends: {known or 'none'}."
        )
    return backend


def format_columns(rows: Iterable[Sequence[str]]) -> list[str]:
    """Return rows as lines of left-aligned columns; the last one is not padded."""
    rows = list(rows)
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join(
            [*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]
        ).rstrip()
        for row in rows
    ]
