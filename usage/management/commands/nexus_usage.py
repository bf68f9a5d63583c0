"""Print token usage per model, backend or client key over a recent period."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError
from django.utils import timezone

from usage.models import ApiKey, TokenUsage, UsageBucket, UsageRecord
from usage.periods import PERIOD_HELP, parse_moment

COLUMNS = (
    ("requests", "requests"),
    ("errors", "errors"),
    ("prompt_tokens", "prompt"),
    ("completion_tokens", "completion"),
    ("total_tokens", "total"),
)


class Command(BaseCommand):
    help = (
        "Print requests, errors and tokens per model, backend or client key, from "
        "the rolled-up usage. Estimated is the share of tokens Nexus estimated "
        "because the backend reported none."
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
            choices=("model", "backend", "key"),
            default="model",
            help="What each row stands for (default: model).",
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
        try:
            rows = self._summarize(by, since)
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
                        "rows": rows,
                        "pending_records": pending,
                    },
                    indent=2,
                )
            )
            return
        self._print_table(by, since, rows)
        if pending:
            self.stdout.write(
                f"{pending} more request{'s' * (pending != 1)} not rolled up yet "
                "(`manage.py nexus_flush_usage` does it now)."
            )

    def _summarize(self, by: str, since: Any) -> list[dict[str, Any]]:
        source = (
            TokenUsage.objects.all()
            if since is None
            else UsageBucket.objects.between(since)
        )
        rows = [dict(row) for row in source.summarize([by])]
        names = {}
        if by == "key":
            prefixes = [row["api_key_prefix"] for row in rows]
            names = dict(
                ApiKey.objects.filter(prefix__in=prefixes).values_list("prefix", "name")
            )
        for row in rows:
            if by == "key":
                prefix = row.pop("api_key_prefix")
                row["key"] = prefix
                row["key_name"] = names.get(prefix)
            row["estimated_share"] = (
                row["estimated_tokens"] / row["total_tokens"]
                if row["total_tokens"]
                else 0.0
            )
            row["latency_ms_avg"] = (
                row.pop("latency_ms_sum") / row["requests"] if row["requests"] else None
            )
        rows.sort(key=lambda row: (-row["total_tokens"], str(row[by])))
        return rows

    def _print_table(self, by: str, since: Any, rows: list[dict[str, Any]]) -> None:
        period = "all time" if since is None else f"since {since:%Y-%m-%d %H:%M} UTC"
        if not rows:
            self.stdout.write(f"No usage {period}.")
            return
        header = [by, *(title for _, title in COLUMNS), "estimated"]
        table = [header]
        totals = dict.fromkeys((name for name, _ in COLUMNS), 0)
        estimated_tokens = 0
        for row in rows:
            table.append(
                [
                    _label(by, row),
                    *(f"{row[name]:,}" for name, _ in COLUMNS),
                    f"{row['estimated_share']:.0%}",
                ]
            )
            for name, _ in COLUMNS:
                totals[name] += row[name]
            estimated_tokens += row["estimated_tokens"]
        share = (
            estimated_tokens / totals["total_tokens"] if totals["total_tokens"] else 0
        )
        table.append(
            ["total", *(f"{totals[name]:,}" for name, _ in COLUMNS), f"{share:.0%}"]
        )
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        self.stdout.write(f"Usage by {by}, {period}:")
        for index, line in enumerate(table):
            cells = [line[0].ljust(widths[0])]
            cells += [
                cell.rjust(width)
                for cell, width in zip(line[1:], widths[1:], strict=True)
            ]
            self.stdout.write("  ".join(cells).rstrip())
            if index == 0 or index == len(table) - 2:
                self.stdout.write("  ".join("-" * width for width in widths))


def _label(by: str, row: dict[str, Any]) -> str:
    if by != "key":
        return str(row[by]) or "(none)"
    if not row["key"]:
        return "anonymous"
    name = row["key_name"] or "deleted key"
    return f"{name} ({row['key']}…)"
