"""``nexus-worker``'s command line (also ``python -m nexus_worker``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from nexus_worker.backend import KINDS
from nexus_worker.daemon import Worker, WorkerConfig

DESCRIPTION = (
    "Connect this machine's model server to a Nexus gateway: the worker dials out "
    "over a WebSocket (no inbound port needed), advertises the local models and "
    "serves the requests the gateway sends it. Needs no database."
)
SECRET_ENV = "NEXUS_WORKER_SECRET"
BACKEND_KEY_ENV = "NEXUS_WORKER_BACKEND_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nexus-worker", description=DESCRIPTION)
    parser.add_argument(
        "--server",
        required=True,
        help="The gateway's base URL, http or https (e.g. http://gateway:8000).",
    )
    parser.add_argument(
        "--secret",
        help=f"The worker secret from the gateway. Prefer ${SECRET_ENV}: a command "
        "line is visible to every user of this machine.",
    )
    parser.add_argument(
        "--backend",
        default="http://127.0.0.1:11434",
        help="The local model server's base URL (default Ollama's, %(default)s).",
    )
    parser.add_argument(
        "--backend-kind",
        choices=KINDS,
        default="auto",
        help="How to list models: Ollama's /api/tags or OpenAI's /v1/models; "
        "auto tries both in that order.",
    )
    parser.add_argument(
        "--backend-key",
        help=f"API key the local server wants (or ${BACKEND_KEY_ENV}).",
    )
    parser.add_argument(
        "--name",
        default=socket.gethostname()[:200],
        help="This worker's name on the gateway (default the host name).",
    )
    parser.add_argument(
        "--max-concurrency",
        type=_positive_int,
        default=4,
        help="Requests served at once (default %(default)s).",
    )
    parser.add_argument(
        "--models-refresh",
        type=_positive_float,
        default=60.0,
        metavar="SECONDS",
        help="How often to re-list the local models (default %(default)s).",
    )
    parser.add_argument(
        "--drain-timeout",
        type=_positive_float,
        default=120.0,
        metavar="SECONDS",
        help="On SIGTERM/Ctrl-C, how long to let requests in flight finish "
        "(default %(default)s; a second signal stops at once).",
    )
    parser.add_argument(
        "--backend-timeout",
        type=_positive_float,
        default=300.0,
        metavar="SECONDS",
        help="Silence from the local server after which a request fails "
        "(default %(default)s).",
    )
    parser.add_argument(
        "--memory-gb",
        type=_positive_float,
        default=None,
        help="Memory the local server's models may fill (GB), for the gateway's "
        "fleet scheduling; default: unknown, models are never ruled out for it.",
    )
    parser.add_argument(
        "--allow-model-management",
        action="store_true",
        help="Let the gateway pull, push, copy, create and delete models on the "
        "local Ollama server, for its keys that may manage models (default: "
        "inference only).",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options and run the worker until it drains; return the exit status."""
    parser = build_parser()
    options = parser.parse_args(argv)
    logging.basicConfig(
        level=options.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    secret = options.secret or os.environ.get(SECRET_ENV, "")
    if not secret:
        parser.error(f"no secret: set ${SECRET_ENV} (or pass --secret)")
    config = WorkerConfig(
        server=options.server,
        secret=secret,
        backend=options.backend,
        name=options.name,
        backend_kind=options.backend_kind,
        backend_key=options.backend_key or os.environ.get(BACKEND_KEY_ENV) or None,
        max_concurrency=options.max_concurrency,
        models_refresh_secs=options.models_refresh,
        drain_timeout_secs=options.drain_timeout,
        backend_timeout_secs=options.backend_timeout,
        memory_gb=options.memory_gb,
        allow_model_management=options.allow_model_management,
    )
    try:
        worker = Worker(config)
    except ValueError as exc:
        parser.error(str(exc))
    return asyncio.run(_run(worker))


async def _run(worker: Worker) -> int:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _on_signal, worker, signal.Signals(signum).name)
    return await worker.run()


def _on_signal(worker: Worker, name: str) -> None:
    """The first signal drains; a second one stops at once."""
    if worker.draining:
        worker.stop_now()
    else:
        worker.drain(None, name)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not more than 0")
    return value
