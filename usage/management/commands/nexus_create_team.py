"""Create a team of client keys with shared limits and budgets."""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, CommandParser
from django.db import IntegrityError

from nexus_lib.commands import DatabaseCommand
from nexus_lib.validation import describe_validation_error
from usage.models import Team


class Command(DatabaseCommand):
    help = (
        "Create a team whose limits and budgets every key of it draws on "
        "together, on top of each key's own (nexus_create_key --team NAME)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The team's name (unique).")
        parser.add_argument(
            "--budget-tokens", type=int, help="Tokens per budget period, all keys."
        )
        parser.add_argument(
            "--budget-usd", help="Spend (USD) per budget period, all keys."
        )
        parser.add_argument(
            "--period",
            choices=("day", "month", "total"),
            default="month",
            help="What the budgets cover (default: month, UTC).",
        )
        parser.add_argument("--rpm", type=int, help="Requests per minute, all keys.")
        parser.add_argument("--tpm", type=int, help="Tokens per minute, all keys.")
        parser.add_argument(
            "--max-concurrency", type=int, help="Requests in flight at once."
        )
        parser.add_argument(
            "--json", dest="as_json", action="store_true", help="Print JSON."
        )

    def handle(self, *args: Any, name: str, as_json: bool, **options: Any) -> None:
        team = Team(
            name=name.strip(),
            budget_tokens=options["budget_tokens"],
            budget_usd=_usd(options["budget_usd"]),
            budget_period=options["period"],
            rpm_limit=options["rpm"],
            tpm_limit=options["tpm"],
            max_concurrency=options["max_concurrency"],
        )
        try:
            team.full_clean()
            team.save()
        except ValidationError as error:
            raise CommandError(
                f"Cannot create the team: {describe_validation_error(error)}"
            ) from None
        except IntegrityError:
            raise CommandError(f"A team named {team.name!r} exists.") from None
        if as_json:
            self.stdout.write(json.dumps({"id": team.pk, "name": team.name}))
            return
        self.stdout.write(f"Created team {team.name!r} (id {team.pk}).")


def _usd(value: str | None) -> Decimal | None:
    if value is None:
        return None
    try:
        return Decimal(value)
    except InvalidOperation:
        raise CommandError(f"--budget-usd: not a number: {value!r}") from None
