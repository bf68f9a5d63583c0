"""Print token usage per model, backend, client key or team over a period."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError
from django.utils import timezone

from nexus_lib.commands import DatabaseCommand
from usage.models import (
    USAGE_DIMENSIONS,
    UsageRecord,
    describe_key,
    select_usage_rows,
)
from usage.periods import PERIOD_HELP, parse_moment
from usage.split_report import split_report

COLUMNS = (
    ("requests", "requests"),
    ("errors", "errors"),
    ("prompt_tokens", "prompt"),
    ("cache_read_tokens", "cached"),
    ("cache_write_tokens", "cache-write"),
    ("completion_tokens", "completion"),
    ("total_tokens", "total"),
)


class Command(DatabaseCommand):
    help = (
        "Print requests, errors, tokens and cost per model, backend, client key "
        "or team, "
        "from the rolled-up usage. Cached and cache-write are the prompt tokens "
        "a backend read from or wrote to its prompt cache. Estimated is the share "
        "of tokens Nexus estimated because the backend reported none; cache hits "
        "the requests answered from the response cache (and their share), saved "
        "the tokens of those answers."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--since",
            default="24h",
            help=f'Start of the period: {PERIOD_HELP}, or "all" for all time '
            "(default: 24h).",
        )
        parser.add_argument(
            "--by",
            choices=("model", "backend", "key", "team", "split"),
            default="model",
            help="What each row stands for (default: model). split: each side of "
            "each weighted split, with p50/p95 latency, from the usage records "
            "(kept NEXUS_USAGE_RECORD_RETENTION_HOURS).",
        )
        parser.add_argument("--json", action="store_true", help="Print JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        by: str = options["by"]
        since = None
        if options["since"] != "all":
            try:
                since = parse_moment(options["since"])
            except ValueError as error:
                raise CommandError(f"--since: {error}") from None
        if by == "split":
            self._print_splits(since, options["json"])
            return
        try:
            usage = select_usage_rows(since)
            rows = list(usage.report([by]))
            totals = usage.totals() if rows and not options["json"] else None
            pending = UsageRecord.objects.pending().count()
        except DatabaseError as error:
            raise CommandError(f"Could not read usage: {error}") from error

        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "since": since.isoformat() if since else None,
                        "until": timezone.now().isoformat(),
                        "by": by,
                        "rows": [_scripted(by, row) for row in rows],
                        "pending_records": pending,
                    },
                    indent=2,
                )
            )
            return
        period = "all time" if since is None else f"since {since:%Y-%m-%d %H:%M} UTC"
        if totals is None:
            self.stdout.write(f"No usage {period}.")
        else:
            self.stdout.write(f"Usage by {by}, {period}:")
            self._print_table(by, rows, totals)
        if pending:
            self.stdout.write(
                f"{pending} more request{'s' * (pending != 1)} not rolled up yet "
                "(`manage.py nexus_flush_usage` does it now)."
            )

    def _print_splits(self, since: datetime | None, as_json: bool) -> None:
        try:
            sides = split_report(since)
        except DatabaseError as error:
            raise CommandError(f"Could not read usage: {error}") from error
        if as_json:
            self.stdout.write(
                json.dumps(
                    {
                        "since": since.isoformat() if since else None,
                        "by": "split",
                        "rows": [side.as_dict() for side in sides],
                    },
                    indent=2,
                )
            )
            return
        period = "all kept" if since is None else f"since {since:%Y-%m-%d %H:%M} UTC"
        if not sides:
            self.stdout.write(f"No split traffic {period}.")
            return
        self.stdout.write(f"Usage by split side, {period}:")
        header = ["split", "side", "requests", "errors", "p50 ms", "p95 ms"]
        header += ["prompt", "completion", "cost (USD)"]
        table = [header]
        for side in sides:
            table.append(
                [
                    side.split,
                    side.side,
                    f"{side.requests:,}",
                    f"{side.errors:,} ({side.errors / side.requests:.0%})",
                    f"{side.p50_ms:,.1f}",
                    f"{side.p95_ms:,.1f}",
                    f"{side.prompt_tokens:,}",
                    f"{side.completion_tokens:,}",
                    f"{side.cost_usd:,.4f}",
                ]
            )
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        for index, line in enumerate(table):
            cells = [
                cell.ljust(width)
                for cell, width in zip(line[:2], widths[:2], strict=True)
            ]
            cells += [
                cell.rjust(width)
                for cell, width in zip(line[2:], widths[2:], strict=True)
            ]
            self.stdout.write("  ".join(cells).rstrip())
            if index == 0:
                self.stdout.write("  ".join("-" * width for width in widths))

    def _print_table(
        self, by: str, rows: list[dict[str, Any]], totals: dict[str, Any]
    ) -> None:
        header = [
            by,
            *(title for _, title in COLUMNS),
            "cost (USD)",
            "estimated",
            "cache hits",
            "saved",
        ]
        labelled = [(_label(by, row), row) for row in rows] + [("total", totals)]
        table = [header]
        for label, row in labelled:
            table.append(
                [
                    label,
                    *(f"{row[name]:,}" for name, _ in COLUMNS),
                    f"{row['cost_usd']:,.4f}",
                    f"{row['estimated_share']:.0%}",
                    f"{row['cache_hits']:,} ({row['cache_hit_rate']:.0%})",
                    f"{row['cache_saved_tokens']:,}",
                ]
            )
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        for index, line in enumerate(table):
            cells = [line[0].ljust(widths[0])]
            cells += [
                cell.rjust(width)
                for cell, width in zip(line[1:], widths[1:], strict=True)
            ]
            self.stdout.write("  ".join(cells).rstrip())
            if index == 0 or index == len(table) - 2:
                self.stdout.write("  ".join("-" * width for width in widths))


def _scripted(by: str, row: dict[str, Any]) -> dict[str, Any]:
    """A report row as --json prints it: the mean latency, not the sum."""
    row = {name: value for name, value in row.items() if name != "latency_ms_sum"}
    row["cost_usd"] = str(row["cost_usd"])
    if by == "key":
        row["key"] = row.pop("api_key_prefix")
    if by == "team":
        row["team"] = row.pop("team_name")
    return row


def _label(by: str, row: dict[str, Any]) -> str:
    if by == "key":
        return describe_key(row["api_key_prefix"], row["key_name"])
    if by == "team":
        return row["team_name"] or "(no team)"
    return str(row[USAGE_DIMENSIONS[by]]) or "(none)"
