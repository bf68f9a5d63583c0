"""Show where a request for a model would be routed, and why."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandError, CommandParser

from nexus_lib.commands import DatabaseCommand
from routing.core import LiveStats, RequestRequirements, Router, RoutingError
from routing.core.prefix import (
    EmptyPrefixView,
    PrefixRequest,
    chain_keys,
    prompt_text,
)
from routing.explain import describe_weights, render_decision
from routing.past_requests import explain_request, render_explained
from routing.snapshot import build_snapshot


class Command(DatabaseCommand):
    help = (
        "Route a hypothetical request for MODEL with the current configuration and "
        "print the chosen backend, or the error a client would get. --explain shows "
        "every candidate's score and why each other backend was excluded. Load "
        "figures are this command's own (zero); latency comes from health checks. "
        "--request-id ID explains a request already served, as it was decided."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model", nargs="?")
        parser.add_argument(
            "--request-id",
            help="Explain a request already served, from its usage record: the "
            "decision as it was (candidates and scores then, the split side, "
            "whether it was hedged or answered from the cache).",
        )
        parser.add_argument("--vision", action="store_true", help="Needs vision.")
        parser.add_argument("--tools", action="store_true", help="Needs tools.")
        parser.add_argument(
            "--json",
            dest="json_mode",
            action="store_true",
            help="Needs JSON mode (response_format json_object / json_schema).",
        )
        parser.add_argument(
            "--tokens", type=int, default=0, help="Estimated prompt tokens."
        )
        parser.add_argument(
            "--prompt",
            default="",
            help="The user message, for prefix routing's signal (this command "
            "holds no prefix index: the matches are the serving processes'; "
            "their explain API shows them).",
        )
        parser.add_argument("--session", help="A session id (x-session-id).")
        parser.add_argument(
            "--key",
            default="",
            help="A client key's visible prefix (nx-...): the side of a split "
            "sticky per key that this key lands on (without it, a random side).",
        )
        parser.add_argument("--explain", action="store_true")
        parser.add_argument(
            "--format",
            choices=("text", "json"),
            default="text",
            help="json prints the full decision record.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["request_id"] is not None:
            self._explain_past(options["request_id"], options["format"])
            return
        if options["model"] is None:
            raise CommandError("Give a MODEL, or --request-id ID of a served request.")
        if options["tokens"] < 0:
            raise CommandError("--tokens cannot be negative.")
        try:
            requirements = RequestRequirements(
                model=options["model"],
                estimated_tokens=options["tokens"],
                needs_vision=options["vision"],
                needs_tools=options["tools"],
                needs_json_mode=options["json_mode"],
            )
        except RoutingError as error:
            raise CommandError(f"error {error.status}: {error}") from error
        routes = build_snapshot()
        prefix = None
        policy = routes.policy.prefix
        if policy.enabled:
            text = prompt_text(
                {"messages": [{"role": "user", "content": options["prompt"]}]}
            )
            keys, blocks = chain_keys(text, policy.block_chars)
            prefix = PrefixRequest(keys, blocks, options["session"], EmptyPrefixView())
        decision = Router().explain(
            requirements, routes, LiveStats(), prefix, split_key=options["key"]
        )
        record = decision.as_dict()
        weights = describe_weights(routes.policy.weights)
        if options["format"] == "json":
            self.stdout.write(json.dumps({**record, "weights": weights}, indent=2))
        else:
            self.stdout.write(
                render_decision(record, explain=options["explain"], weights=weights)
            )
        if decision.error is not None:
            raise CommandError(f"no route (HTTP {decision.error.status})", returncode=2)

    def _explain_past(self, request_id: str, output: str) -> None:
        found = explain_request(request_id)
        if not found:
            raise CommandError(
                f"No served request with id '{request_id}' (usage is recorded "
                "within seconds and kept NEXUS_USAGE_RECORD_RETENTION_HOURS)."
            )
        if output == "json":
            self.stdout.write(json.dumps(found, indent=2))
            return
        self.stdout.write("\n\n".join(render_explained(entry) for entry in found))
