"""A TCP forwarder the tests can cut: a database or Redis outage on demand.

``TcpCut(("127.0.0.1", 5432))`` listens on a free local port and forwards
every connection to the target. ``cut()`` closes every forwarded connection
and stops listening (new connections are refused, as from a server that is
down); ``restore()`` listens again on the same port. Threads, so that it runs
beside any test (sync or async) and beside the processes the test started.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpCut:
    """Forward a local port to `target` until cut (see the module docstring)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.restore()

    def restore(self) -> None:
        """Accept and forward connections (again)."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Refuse new connections and break every open one."""
        # Under the lock: a connection accepted just before the cut but not
        # yet forwarded is closed by its accepting thread, which sees the cut
        # (on a loaded machine, a test once cut between the two and the
        # connection went on forwarding).
        with self._lock:
            listener, self._listener = self._listener, None
            connections, self._connections = self._connections, set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.cut()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                is_cut = self._listener is not listener
                if not is_cut:
                    self._connections |= {client, upstream}
            if is_cut:
                client.close()
                upstream.close()
                return
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(source, sink), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._connections.discard(source)
                self._connections.discard(sink)
