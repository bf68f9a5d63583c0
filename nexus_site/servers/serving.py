"""How a serving process runs: collector tuning, Daphne's settings, SIGTERM.

``prepare_daphne()`` applies only when Daphne is the server (its command line
is loaded, as under ``nexus_run`` and in the Docker image):

* Twisted parses the body of every POST as a form submission before the
  application sees it; Nexus never reads forms that way (Django parses its own),
  so that costly step is turned off.
* Clients are refused and timed out before the application runs where
  Daphne would otherwise read their whole body first
  (``nexus_site.servers.daphne_limits``).
* A relay worker's consumer can stop Daphne reading the worker's socket
  while the worker is over its rates (``nexus_site.servers.daphne_relay``).
* Daphne's access log writes a line per request to stdout; gateway paths log
  their own structured line instead (logger ``nexus.access``), so Daphne's is
  kept for Django's pages only.
* Daphne sends no lifespan events: the gateway starts as soon as the reactor
  runs, the collector is tuned, and SIGTERM drains instead of cancelling
  every request at once: /health/ready turns 503, new /v1 requests get a 503,
  requests and streams in flight finish within ``NEXUS_DRAIN_SECONDS``, the
  usage still held is handed on, and the process exits 0. A second SIGTERM
  stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

from gateway.process import Gateway, tune_garbage_collector
from gateway.proxy import ProxyApp
from nexus_site.servers.daphne_limits import ClientLimits, install_daphne_limits
from nexus_site.servers.daphne_relay import install_websocket_reading_hooks
from nexus_worker.protocol import MAX_FRAME_BYTES as RELAY_MAX_FRAME_BYTES

logger = logging.getLogger(__name__)

# Paths whose requests the gateway logs itself (or that are polled often).
GATEWAY_PATHS = ("/v1/", "/v1", "/metrics", "/health/live", "/health/ready")

_tuned = False


def tune_process() -> None:
    """Tune the garbage collector once per process, after start-up."""
    global _tuned
    if not _tuned:
        _tuned = True
        tune_garbage_collector()


def is_daphne_serving() -> bool:
    return "daphne.cli" in sys.modules


def prepare_daphne(gateway: Gateway, proxy: ProxyApp) -> None:
    """Configure Daphne for the gateway (see the module docstring)."""
    if not is_daphne_serving():
        return
    from daphne.http_protocol import WebRequest
    from daphne.server import Server
    from twisted.internet import reactor as twisted_reactor

    reactor: Any = twisted_reactor

    init = WebRequest.__init__

    def init_without_form_parsing(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parsePOSTFormSubmission", False)
        init(self, *args, **kwargs)

    WebRequest.__init__ = init_without_form_parsing
    install_daphne_limits(gateway, proxy, ClientLimits.from_settings())
    install_websocket_reading_hooks()

    log_action = Server.log_action

    def log_django_only(
        self: Any, protocol: str, action: str, details: dict[str, Any]
    ) -> None:
        if protocol == "http" and str(details.get("path", "")).startswith(
            GATEWAY_PATHS
        ):
            return
        log_action(self, protocol, action, details)

    Server.log_action = log_django_only

    def when_running() -> None:
        # Called by the reactor's loop, where asyncio.get_running_loop() works.
        gateway.ensure_started()
        tune_process()
        _drain_on_sigterm(gateway, reactor)

    # Start-up triggers run before the loop does: go through callLater.
    reactor.callWhenRunning(lambda: reactor.callLater(0, when_running))


def _drain_on_sigterm(gateway: Gateway, reactor: Any) -> None:
    loop = asyncio.get_running_loop()
    state = {"stopping": False}

    async def shut_down() -> None:
        logger.info(
            "SIGTERM: draining %d requests in flight (up to %g s)",
            gateway.active,
            gateway.config.drain_seconds,
        )
        await gateway.drain()
        await gateway.stop()
        logger.info("Drained; stopping")
        reactor.stop()

    def on_sigterm() -> None:
        if state["stopping"]:
            logger.warning("Second SIGTERM: stopping now")
            reactor.stop()
            return
        state["stopping"] = True
        loop.create_task(shut_down(), name="drain")

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)


SERVERS = ("daphne", "uvicorn", "granian")
ASGI_APP = "nexus_site.asgi:application"


def server_commands(
    server: str,
    *,
    fd: int,
    host: str,
    port: int,
    workers: int,
    proxy_headers: bool = False,
    drain_seconds: float = 30.0,
    header_timeout: float = 15.0,
) -> list[list[str]]:
    """The command lines of the serving processes ``nexus_run`` starts.

    Daphne and uvicorn processes each accept on the listening socket `fd` that
    the launcher opened once; granian binds the port itself and runs its own
    worker processes, so it is one command.

    `header_timeout` (``NEXUS_CLIENT_HEADER_TIMEOUT``): the seconds a client
    has to send a request's head; uvicorn gets it through
    ``nexus_site.servers.uvicorn_main`` (a 408, then the connection closed), granian
    as ``--http1-header-read-timeout`` (at most 60 s there; the connection
    closed). Daphne reads it from the settings (nexus_site.servers.daphne_limits). The
    body's deadline is the proxy's own under uvicorn and granian (they hand it
    the head first).
    """
    python = sys.executable
    if server == "daphne":
        daphne = [python, "-m", "nexus_site.servers.daphne_main", "--fd", str(fd)]
        # Relay workers: 16 MiB frames (the protocol's limit), sockets for good.
        daphne += [
            "--websocket-max-message-size",
            str(RELAY_MAX_FRAME_BYTES),
            "--websocket-max-frame-size",
            str(RELAY_MAX_FRAME_BYTES),
            "--websocket_timeout",
            "-1",
        ]
        if proxy_headers:
            daphne.append("--proxy-headers")
        return [[*daphne, ASGI_APP] for _ in range(workers)]
    if server == "uvicorn":
        uvicorn = [
            python,
            "-m",
            "nexus_site.servers.uvicorn_main",
            "--fd",
            str(fd),
            "--timeout-graceful-shutdown",
            str(max(1, round(drain_seconds))),
            "--header-timeout",
            str(header_timeout),
        ]
        if proxy_headers:
            uvicorn.append("--proxy-headers")
        return [[*uvicorn, ASGI_APP] for _ in range(workers)]
    if server == "granian":
        return [
            [
                python,
                "-m",
                "granian",
                "--interface",
                "asgi",
                "--host",
                host,
                "--port",
                str(port),
                "--workers",
                str(workers),
                "--no-access-log",
                # Milliseconds, 1 to 60,000 (granian's bounds).
                "--http1-header-read-timeout",
                str(min(60_000, max(1, round(header_timeout * 1000)))),
                ASGI_APP,
            ]
        ]
    raise ValueError(f"Unknown server {server!r}; choose one of {', '.join(SERVERS)}")
