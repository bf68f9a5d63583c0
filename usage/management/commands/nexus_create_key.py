"""Create a client API key and print it once."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, CommandParser

from nexus_lib.commands import DatabaseCommand
from nexus_lib.validation import describe_validation_error
from usage.models import ApiKey, Team


class Command(DatabaseCommand):
    help = (
        "Create a client API key for the gateway and print it. Only a hash is "
        "stored, so this is the only time the key is shown."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="What the key is for, e.g. a team or app.")
        parser.add_argument(
            "--models",
            default="",
            help="Comma-separated model names, aliases or glob patterns the key "
            "may use (default: all).",
        )
        parser.add_argument("--rpm", type=int, help="Requests per minute.")
        parser.add_argument("--tpm", type=int, help="Tokens per minute.")
        parser.add_argument(
            "--max-concurrency", type=int, help="Requests in flight at once."
        )
        parser.add_argument(
            "--budget-tokens", type=int, help="Tokens per budget period."
        )
        parser.add_argument("--budget-usd", help="Spend (USD) per budget period.")
        parser.add_argument(
            "--budget-period",
            choices=("day", "month", "total"),
            default="month",
            help="What the budgets cover (default: month, UTC).",
        )
        parser.add_argument(
            "--expires",
            help="ISO date or date-time after which the key is refused (UTC "
            "unless it names a zone).",
        )
        parser.add_argument(
            "--team",
            help="The team (by name) the key belongs to: its limits and budgets "
            "hold the key's requests too (nexus_create_team).",
        )
        parser.add_argument(
            "--manage-models",
            action="store_true",
            help="Let the key pull, push, copy, create and delete models on "
            "Ollama backends through the gateway (/api/pull and the like).",
        )
        parser.add_argument(
            "--json",
            dest="as_json",
            action="store_true",
            help='Print {"name", "prefix", "key"} as JSON for scripts.',
        )

    def handle(
        self, *args: Any, name: str, as_json: bool, team: str | None, **options: Any
    ) -> None:
        limits = _limits(options)
        owner = None
        if team is not None:
            owner = Team.objects.filter(name=team).first()
            if owner is None:
                raise CommandError(f"--team: no team is named {team!r}.")
        try:
            key, raw = ApiKey.objects.create_key(name.strip(), team=owner, **limits)
        except ValidationError as error:
            raise CommandError(
                f"Cannot create the key: {describe_validation_error(error)}"
            ) from None
        if as_json:
            payload = {"name": key.name, "prefix": key.prefix, "key": raw}
            self.stdout.write(json.dumps(payload))
            return
        self.stdout.write(f"Created API key {key.name!r} ({key.prefix}…):")
        self.stdout.write(raw)
        self.stdout.write(
            "Copy it now: only its hash is stored, so it will not be shown again."
        )


def _limits(options: dict[str, Any]) -> dict[str, Any]:
    limits: dict[str, Any] = {
        "allowed_models": options["models"],
        "rpm_limit": options["rpm"],
        "tpm_limit": options["tpm"],
        "max_concurrency": options["max_concurrency"],
        "budget_tokens": options["budget_tokens"],
        "budget_period": options["budget_period"],
        "can_manage_models": options["manage_models"],
    }
    if options["budget_usd"] is not None:
        try:
            limits["budget_usd"] = Decimal(options["budget_usd"])
        except InvalidOperation:
            raise CommandError(
                f"--budget-usd: not a number: {options['budget_usd']!r}"
            ) from None
    if options["expires"]:
        try:
            expires = datetime.fromisoformat(options["expires"])
        except ValueError:
            raise CommandError(
                f"--expires: not an ISO date: {options['expires']!r}"
            ) from None
        if expires.tzinfo is None:
            expires = expires.replace(tzinfo=UTC)
        limits["expires_at"] = expires
    return limits
