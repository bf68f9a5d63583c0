"""Create a client API key and print it once."""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from usage.models import ApiKey


class Command(BaseCommand):
    help = (
        "Create a client API key for the gateway and print it. Only a hash is "
        "stored, so this is the only time the key is shown."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="What the key is for, e.g. a team or app.")
        parser.add_argument(
            "--json",
            dest="as_json",
            action="store_true",
            help='Print {"name", "prefix", "key"} as JSON for scripts.',
        )

    def handle(self, *args: Any, name: str, as_json: bool, **options: Any) -> None:
        try:
            key, raw = ApiKey.objects.create_key(name.strip())
        except ValidationError as error:
            raise CommandError(f"Cannot create the key: {_describe(error)}") from None
        if as_json:
            payload = {"name": key.name, "prefix": key.prefix, "key": raw}
            self.stdout.write(json.dumps(payload))
            return
        self.stdout.write(f"Created API key {key.name!r} ({key.prefix}…):")
        self.stdout.write(raw)
        self.stdout.write(
            "Copy it now: only its hash is stored, so it will not be shown again."
        )


def _describe(error: ValidationError) -> str:
    if hasattr(error, "error_dict"):
        return " ".join(
            f"{field}: {message}"
            for field, messages in error.message_dict.items()
            for message in messages
        )
    return " ".join(error.messages)
