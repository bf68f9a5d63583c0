"""The mock backend's listening socket, which can refuse and resume on one port."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from nexus_mock.protocol import HttpConnection

BACKLOG = 1024


class ListenError(Exception):
    """The mock could not bind its address."""


class Listener:
    """The listening socket, which can stop listening and resume on the same port.

    While refusing, the port stays bound but not listening, so connects get
    ECONNREFUSED and the port is not handed to anyone else.
    """

    def __init__(
        self, host: str, port: int, protocol_factory: Callable[[], HttpConnection]
    ) -> None:
        self.host = host
        self.port = port
        self._factory = protocol_factory
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._opening = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def is_listening(self) -> bool:
        return self._server is not None

    def bind(self) -> None:
        """Bind the port (picking one when it is 0); raise ListenError if taken."""
        try:
            self._sock = _bind_socket(self.host, self.port)
        except OSError as error:
            raise ListenError(
                f"Cannot listen on {self.host}:{self.port}: {error.strerror or error}"
            ) from error
        self.port = self._sock.getsockname()[1]

    async def listen(self) -> None:
        if self._server is not None or self._opening:
            return
        self._opening = True
        try:
            sock = self._sock or _bind_socket(self.host, self.port)
            self._sock = None
            sock.listen(BACKLOG)
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(
                self._factory, sock=sock, backlog=BACKLOG
            )
        finally:
            self._opening = False

    def refuse(self) -> None:
        if self._server is None:
            return
        self._server.close()
        self._server = None
        try:
            self._sock = _bind_socket(self.host, self.port)
        except OSError:
            # Someone else took the port; listen() will retry the bind.
            self._sock = None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _bind_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
