"""Giving freed memory back to the system after a burst of large buffers.

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

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


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
