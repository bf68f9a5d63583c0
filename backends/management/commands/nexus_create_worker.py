"""Create a relay worker's secret and print it once."""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, CommandParser

from backends.models import Worker
from nexus_lib.commands import DatabaseCommand
from nexus_lib.validation import describe_validation_error


class Command(DatabaseCommand):
    help = (
        "Create a relay worker (a GPU box behind NAT that dials in with "
        "nexus-worker) and print its secret. Only a hash is stored, so this is "
        "the only time the secret is shown."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "name", help="The worker's name; also its backend's name in routing."
        )
        parser.add_argument(
            "--models",
            default="",
            metavar="NAMES",
            help="Comma-separated model names or glob patterns (llama3:*) the "
            "worker may serve; by default any name no direct backend serves.",
        )
        parser.add_argument(
            "--may-shadow-direct-backends",
            dest="may_shadow",
            action="store_true",
            help="Let it also serve names a direct (non-relay) backend serves.",
        )
        parser.add_argument(
            "--json",
            dest="as_json",
            action="store_true",
            help='Print {"name", "prefix", "secret"} as JSON for scripts.',
        )

    def handle(
        self,
        *args: Any,
        name: str,
        models: str,
        may_shadow: bool,
        as_json: bool,
        **options: Any,
    ) -> None:
        try:
            worker, raw = Worker.objects.create_worker(name, models, may_shadow)
        except ValidationError as error:
            raise CommandError(
                f"Cannot create the worker: {describe_validation_error(error)}"
            ) from None
        if as_json:
            payload = {
                "name": worker.name,
                "prefix": worker.prefix,
                "secret": raw,
                "allowed_models": list(worker.model_rules.allowed),
                "may_shadow_direct_backends": worker.may_shadow_direct_backends,
            }
            self.stdout.write(json.dumps(payload))
            return
        self.stdout.write(f"Created relay worker {worker.name!r} ({worker.prefix}…):")
        self.stdout.write(raw)
        self.stdout.write(
            "Copy it now: only its hash is stored, so it will not be shown again."
        )
        self.stdout.write(
            "It may serve: "
            + (", ".join(worker.model_rules.allowed) or "any model")
            + (
                ""
                if worker.may_shadow_direct_backends
                else " (none a direct backend serves)"
            )
        )
        self.stdout.write(
            f"On the worker: nexus-worker --server http://GATEWAY:8000 "
            f"--secret {raw} --backend http://127.0.0.1:11434"
        )
