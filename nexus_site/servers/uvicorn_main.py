"""Run uvicorn on an inherited listening socket: ``python -m nexus_site.servers.uvicorn_main``.

uvicorn's own ``--fd`` wraps the descriptor as a Unix socket, so the TCP
connections it accepts never get TCP_NODELAY and small replies wait ~40 ms for
Nagle's algorithm (measured: 23 requests/s per connection). Here the socket is
adopted with its real family, which uvicorn then treats as TCP.

uvicorn bounds nothing about a client sending its request head slowly (its
keep-alive timeout is reset by every byte): ``--header-timeout`` gives each
request's head that many seconds from the connection opening (or from the
previous response on a kept-alive connection), then a 408 in OpenAI's error
shape and the connection closed, as Daphne does with
``NEXUS_CLIENT_HEADER_TIMEOUT`` (nexus_site.servers.daphne_limits). The body's
deadline is the proxy's own (``NEXUS_CLIENT_BODY_TIMEOUT``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from typing import Any

_HEAD_TIMEOUT_BODY = json.dumps(
    {
        "error": {
            "message": "The request head did not arrive in time.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
    }
).encode()
_HEAD_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n"
    % len(_HEAD_TIMEOUT_BODY)
    + _HEAD_TIMEOUT_BODY
)


def protocol_with_head_deadline(seconds: float) -> type[Any]:
    """uvicorn's httptools protocol, with a deadline on each request's head."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeadDeadlineProtocol(HttpToolsProtocol):
        _head_deadline: asyncio.TimerHandle | None = None
        _head_started = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_started = True

        def on_headers_complete(self) -> None:
            self._disarm_head_deadline()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            waiting = bool(self.pipeline)  # a next head already complete
            super().on_response_complete()
            if not waiting and not self.transport.is_closing():
                self._arm_head_deadline()

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self._head_started = False
            self._head_deadline = self.loop.call_later(seconds, self._head_late)

        def _disarm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_late(self) -> None:
            self._head_deadline = None
            if self.transport.is_closing():
                return
            if self._head_started:  # part of a request came: say why
                self.transport.write(_HEAD_TIMEOUT_RESPONSE)
            self.transport.close()

    return HeadDeadlineProtocol


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nexus_site.servers.uvicorn_main")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--proxy-headers", action="store_true")
    parser.add_argument("--timeout-graceful-shutdown", type=int, default=30)
    parser.add_argument("--header-timeout", type=float, default=15.0)
    parser.add_argument("app")
    options = parser.parse_args(argv)

    import uvicorn

    listener = socket.socket(fileno=options.fd)  # family and type from the fd
    config = uvicorn.Config(
        options.app,
        lifespan="on",
        access_log=False,
        proxy_headers=options.proxy_headers,
        forwarded_allow_ips="*" if options.proxy_headers else None,
        timeout_graceful_shutdown=options.timeout_graceful_shutdown,
        http=protocol_with_head_deadline(options.header_timeout),
    )
    uvicorn.Server(config).run(sockets=[listener])


if __name__ == "__main__":
    main()
