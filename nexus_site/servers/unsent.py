"""What a connection holds for its client: counted, dropped, given back.

Twisted's TCP transport keeps what was written to a connection and not yet
sent in ``dataBuffer`` (from ``offset``) and ``_tempDataBuffer``; Daphne
writes each response body to it as it is sent and buffers none of its own,
so that is all a serving process holds for a client that reads slowly (the
kernel's socket buffers are not the process's memory).

A stalled stream's client leaves up to ``NEXUS_STREAM_MAX_UNSENT_BYTES`` in
the server's transport buffer, which Twisted keeps as a few bytes objects of
up to that size, rebuilt as it writes. glibc's malloc serves such sizes from
its heap once it has freed one of them (its mmap threshold rises to the
largest size freed, up to 32 MiB), and a heap gives back only what is free at
its top: after many such clients leave, their memory stays in the process
(measured: 60 of them left 70 MiB behind for good). ``malloc_trim(0)``
returns every free page of every heap; ``MemoryRelease.soon()`` calls it once
things have settled after such clients were disconnected, at most once a
``delay``. Where there is no glibc it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Callable
from typing import Any

# A dropped buffer this large has its memory given back to the system.
_LARGE_BUFFER = 64 * 1024


def _find_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Any = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _find_malloc_trim()


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system; False where unsupported."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


class MemoryRelease:
    """Calls ``release_free_memory()`` ``delay`` seconds after ``soon()``,
    once for any number of calls meanwhile; ``call_later`` is the reactor's."""

    __slots__ = ("_call_later", "_delay", "_pending")

    def __init__(self, call_later: Callable[..., Any], delay: float = 1.0) -> None:
        self._call_later = call_later
        self._delay = delay
        self._pending = False

    def soon(self) -> None:
        if not self._pending and _malloc_trim is not None:
            self._pending = True
            self._call_later(self._delay, self._release)

    def _release(self) -> None:
        self._pending = False
        release_free_memory()


def unsent_of(transport: Any) -> int:
    """What a transport holds that its client has not read (0: unknown)."""
    try:
        return len(transport.dataBuffer) - transport.offset + transport._tempDataLen
    except AttributeError:
        return 0


def unsent_bytes(request: Any) -> int:
    """Bytes written to the request's connection that the client has not read
    (0 where the transport does not tell: TLS)."""
    channel = getattr(request, "channel", None)
    return unsent_of(getattr(channel, "transport", None))


def abort_connection(request: Any, release: MemoryRelease) -> None:
    """Close the request's connection now, dropping what it has not sent yet;
    the memory that held it is given back to the system shortly after."""
    channel = getattr(request, "channel", None)
    transport = getattr(channel, "transport", None)
    abort = getattr(transport, "abortConnection", None)
    if abort is not None:
        abort()
        drop_unsent(transport, release)


def drop_unsent(transport: Any, release: MemoryRelease) -> None:
    """Free what a closed connection's transport still holds for its client.

    Twisted keeps it on the transport, which lives on as long as anything
    refers to the connection: past the request's end, until the garbage
    collector breaks a cycle (minutes, with the thresholds of a serving
    process). A large buffer's memory is then given back to the system.
    """
    held = unsent_of(transport)
    with contextlib.suppress(AttributeError):
        transport.dataBuffer, transport.offset = b"", 0
        transport._tempDataBuffer, transport._tempDataLen = [], 0
    if held >= _LARGE_BUFFER:
        release.soon()
