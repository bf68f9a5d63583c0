"""Let a relay worker's consumer stop Daphne reading the worker's socket (and
leave the pinging to the relay's heartbeats).

Daphne reads every WebSocket message as it arrives and queues it for the
application without bound: a consumer that waits (a worker over its rates,
gateway/relay/limits.py) would only move the flood into that queue. Each
WebSocket's scope gets the extension ``nexus.reading`` with ``pause()`` and
``resume()``, which stop and restart reading the socket (Twisted's producer
interface): the worker's sends then wait on TCP, and the process holds
nothing more of them.
"""

from __future__ import annotations

import time
from typing import Any

from nexus_worker.protocol import WEBSOCKET_PATH


def install_websocket_reading_hooks() -> None:
    """Patch Daphne's application factory in this process (see the docstring)."""
    from daphne.server import Server

    create_application = Server.create_application

    def create_application_with_reading(self: Any, protocol: Any, scope: Any) -> Any:
        if scope.get("type") == "websocket":
            extensions = scope.setdefault("extensions", {})
            extensions["nexus.reading"] = {
                "pause": lambda: _transport_call(protocol, "pauseProducing"),
                "resume": lambda: _transport_call(protocol, "resumeProducing"),
            }
            if str(scope.get("path", "")).endswith(WEBSOCKET_PATH):
                _without_daphne_pings(protocol)
        return create_application(self, protocol, scope)

    Server.create_application = create_application_with_reading


def _transport_call(protocol: Any, name: str) -> None:
    transport = getattr(protocol, "transport", None)
    if transport is None or getattr(transport, "disconnecting", False):
        return
    call = getattr(transport, name, None)
    if call is not None:
        call()


def _without_daphne_pings(protocol: Any) -> None:
    """No Daphne pings on a relay worker's socket.

    Daphne pings a WebSocket silent for 20 s (``--ping-interval``); the relay
    pings its workers itself (gateway/relay/heartbeats.py: every 5 s, up to
    20 s with many workers), which keeps their sockets alive and finds the
    dead ones. Both would double the frames a heartbeat costs. Daphne's other
    checks (the open handshake's timeout) stay.
    """
    check_timeouts = protocol.check_timeouts

    def check_timeouts_without_ping() -> None:
        protocol.last_ping = time.time()
        check_timeouts()

    protocol.check_timeouts = check_timeouts_without_ping
