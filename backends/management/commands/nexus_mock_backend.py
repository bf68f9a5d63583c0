"""Serve a fake OpenAI-compatible model server (see ``backends.mock``)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from backends.mock import ConfigError, ListenError, MockConfig, run_mock_backend

_KNOB_OPTIONS = (
    "name",
    "models",
    "latency_ms",
    "chunks",
    "chunk_delay_ms",
    "embedding_dim",
    "api_key",
    "fail_status",
    "error_rate",
    "drop_after_chunks",
    "seed",
    "record_requests",
    "kind",
    "context_length",
    "loaded_models",
    "vision_models",
    "tool_models",
)


class Command(BaseCommand):
    help = (
        "Serve a fake OpenAI-compatible model server that echoes what it is asked, "
        "with latency, streaming and failure knobs, and a control API under "
        "/_mock/. Needs no database."
    )
    # The mock must start fast and never touch the database.
    requires_system_checks = ()

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument(
            "--port", type=int, default=8001, help="0 picks a free port."
        )
        parser.add_argument("--name", default="mock", help="Shown in every reply.")
        parser.add_argument(
            "--models", required=True, help="Comma-separated model names served."
        )
        parser.add_argument(
            "--latency-ms", type=float, default=0.0, help="Delay before the response."
        )
        parser.add_argument(
            "--chunks", type=int, default=4, help="Content chunks per stream."
        )
        parser.add_argument("--chunk-delay-ms", type=float, default=0.0)
        parser.add_argument("--embedding-dim", type=int, default=8)
        parser.add_argument(
            "--api-key", help="Require Authorization: Bearer KEY on /v1 requests."
        )
        parser.add_argument(
            "--fail-status",
            type=int,
            help="Status of injected failures (default 500). Given alone, every "
            "inference request fails.",
        )
        parser.add_argument(
            "--error-rate",
            type=float,
            help="Fraction (0..1) of inference requests that fail.",
        )
        parser.add_argument(
            "--drop-after-chunks",
            type=int,
            help="Cut every stream after this many chunks.",
        )
        refuse = parser.add_mutually_exclusive_group()
        refuse.add_argument(
            "--refuse",
            action="store_true",
            help="Start refusing connections; SIGUSR1 starts listening.",
        )
        refuse.add_argument(
            "--refuse-for-ms",
            type=float,
            help="Refuse connections for this long after start-up.",
        )
        parser.add_argument(
            "--seed", type=int, default=0, help="Seed of the failure RNG."
        )
        parser.add_argument(
            "--kind",
            choices=("openai", "ollama", "vllm", "llamacpp", "anthropic"),
            default="openai",
            help="Also serve that kind of server's health and model endpoints.",
        )
        parser.add_argument(
            "--context-length",
            type=int,
            help="Context window the kind's endpoints report (default 8192).",
        )
        parser.add_argument(
            "--loaded-models",
            help="Comma-separated models Ollama's /api/ps lists (default: all).",
        )
        parser.add_argument(
            "--vision-models", help="Comma-separated models reported with vision."
        )
        parser.add_argument(
            "--tool-models", help="Comma-separated models reported with tools."
        )
        parser.add_argument(
            "--loading",
            action="store_true",
            help="llama.cpp kind: answer 503 'Loading model' until the loading "
            "knob is turned off.",
        )
        parser.add_argument(
            "--record-requests",
            type=int,
            default=20,
            help="How many recent requests /_mock/stats shows.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["fail_status"] is not None and options["error_rate"] is None:
            options["error_rate"] = 1.0
        knobs = {key: options[key] for key in _KNOB_OPTIONS if options[key] is not None}
        if options["loading"]:
            knobs["loading"] = True
        refuse_ms = options["refuse_for_ms"]
        if options["refuse"]:
            refuse_ms = 0.0
        elif refuse_ms is not None and refuse_ms <= 0:
            raise CommandError("--refuse-for-ms must be positive.")
        try:
            config = MockConfig.from_knobs(knobs)
        except ConfigError as error:
            raise CommandError(f"--{error.knob.replace('_', '-')}: {error}") from None
        try:
            run_mock_backend(
                config,
                host=options["host"],
                port=options["port"],
                refuse_ms=refuse_ms,
                announce=self._announce,
            )
        except ListenError as error:
            raise CommandError(str(error)) from None

    def _announce(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()
