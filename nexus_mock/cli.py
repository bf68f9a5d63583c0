"""The mock backend's command line, shared by ``python -m`` and ``manage.py``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nexus_mock.config import ConfigError, MockConfig
from nexus_mock.listener import ListenError
from nexus_mock.runner import run_mock_backend

DESCRIPTION = (
    "Serve a fake OpenAI-compatible model server that echoes what it is asked, "
    "with latency, streaming and failure knobs, and a control API under "
    "/_mock/. Needs no database."
)

_KNOB_OPTIONS = (
    "name",
    "models",
    "latency_ms",
    "prefill_ms_per_1k_tokens",
    "chunks",
    "chunk_delay_ms",
    "embedding_dim",
    "api_key",
    "fail_status",
    "error_rate",
    "fail_on_text",
    "drop_after_chunks",
    "seed",
    "record_requests",
    "kind",
    "context_length",
    "loaded_models",
    "vision_models",
    "tool_models",
    "slots",
    "memory_gb",
    "load_seconds",
    "keep_alive_seconds",
    "server_version",
    "prefix_block_chars",
    "prefix_cache_blocks",
    "prefix_block_ms",
    "slow_rate",
    "slow_ms",
)


class UsageError(Exception):
    """A command-line flag has a value the mock cannot serve with."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the mock's flags on ``parser`` (argparse's or a Django command's)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001, help="0 picks a free port.")
    parser.add_argument("--name", default="mock", help="Shown in every reply.")
    parser.add_argument("--models", help="Comma-separated model names served.")
    parser.add_argument(
        "--model",
        action="append",
        metavar="NAME:SIZE_GB",
        help="A model served, with its size in GB (repeat the flag; Ollama "
        "kind: models then load and unload, see --memory-gb).",
    )
    parser.add_argument(
        "--memory-gb",
        type=float,
        help="Ollama kind: memory for loaded models; loading one that does not "
        "fit evicts the least recently used.",
    )
    parser.add_argument(
        "--load-seconds",
        type=float,
        help="Ollama kind: time to load a model that is not loaded (default 0).",
    )
    parser.add_argument(
        "--keep-alive-seconds",
        type=float,
        help="Ollama kind: how long a model stays loaded after its last "
        "request (default 300; a request's keep_alive wins).",
    )
    parser.add_argument(
        "--latency-ms", type=float, default=0.0, help="Delay before the response."
    )
    parser.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=float,
        default=0.0,
        help="Added to the delay per 1,000 prompt tokens (the body's bytes / 4).",
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
        "--fail-on-text",
        help="Fail (with --fail-status) every inference request whose body "
        "holds this text.",
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
    parser.add_argument("--seed", type=int, default=0, help="Seed of the failure RNG.")
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
        "--enforce-context",
        action="store_true",
        help="Refuse chats over --context-length with the kind's own context "
        "overflow error (nexus_mock.overflow).",
    )
    parser.add_argument(
        "--slots",
        type=int,
        help="Serve at most N inference requests at once; the others wait in "
        "arrival order, like a model server's queue (default: no limit).",
    )
    version_help = (
        "The server version the kind reports (Ollama /api/version, vLLM "
        "/version, llama.cpp /props build_info); default: a recent one."
    )
    try:
        parser.add_argument(
            "--version", "--server-version", dest="server_version", help=version_help
        )
    except argparse.ArgumentError:
        # A Django command's parser has Django's own --version.
        parser.add_argument(
            "--server-version", dest="server_version", help=version_help
        )
    parser.add_argument(
        "--prefix-block-chars",
        type=int,
        help="Keep a prompt cache in blocks of this many characters: a "
        "request's leading blocks computed lately cost nothing, the others "
        "--prefix-block-ms each (default: no prompt cache).",
    )
    parser.add_argument(
        "--prefix-cache-blocks",
        type=int,
        help="Blocks the prompt cache holds, least recently used evicted "
        "(default 1024).",
    )
    parser.add_argument(
        "--prefix-block-ms",
        type=float,
        help="Time to compute one prompt block not in the cache (default 0).",
    )
    parser.add_argument(
        "--slow-rate",
        type=float,
        help="Fraction of inference requests whose head waits --slow-ms more "
        "(a tail of slow first bytes; default 0).",
    )
    parser.add_argument(
        "--slow-ms", type=float, help="The slow requests' extra delay (default 0)."
    )
    parser.add_argument(
        "--record-requests",
        type=int,
        default=20,
        help="How many recent requests /_mock/stats shows.",
    )


def serve_from_options(
    options: Mapping[str, Any], announce: Callable[[str], None]
) -> None:
    """Serve with the parsed flags until SIGTERM or SIGINT.

    Raises UsageError for a flag value the mock rejects and ListenError when the
    address cannot be bound.
    """
    knobs = {key: options[key] for key in _KNOB_OPTIONS if options[key] is not None}
    sized = options.get("model") or []
    if sized:
        knobs["model_sizes"] = sized
        names = [item.rpartition(":")[0] or item for item in sized]
        listed = [m for m in (options["models"] or "").split(",") if m.strip()]
        knobs["models"] = ",".join(dict.fromkeys([*listed, *names]))
    if (
        options["fail_status"] is not None
        and options["error_rate"] is None
        and options["fail_on_text"] is None
    ):
        knobs["error_rate"] = 1.0
    if options["loading"]:
        knobs["loading"] = True
    if options.get("enforce_context"):
        knobs["enforce_context"] = True
    refuse_ms = options["refuse_for_ms"]
    if options["refuse"]:
        refuse_ms = 0.0
    elif refuse_ms is not None and refuse_ms <= 0:
        raise UsageError("--refuse-for-ms must be positive.")
    try:
        config = MockConfig.from_knobs(knobs)
    except ConfigError as error:
        raise UsageError(f"--{error.knob.replace('_', '-')}: {error}") from None
    run_mock_backend(
        config,
        host=options["host"],
        port=options["port"],
        refuse_ms=refuse_ms,
        announce=announce,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m nexus_mock``; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m nexus_mock", description=DESCRIPTION
    )
    add_arguments(parser)
    options = vars(parser.parse_args(argv))
    try:
        serve_from_options(options, _print_flushed)
    except UsageError as error:
        parser.error(str(error))
    except ListenError as error:
        sys.stderr.write(f"{error}\n")
        return 1
    return 0


def _print_flushed(line: str) -> None:
    # Whoever started us waits for the start-up line, so it must not sit in a buffer.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
