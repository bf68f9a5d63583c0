"""Live state of a serving process that the pages of lower apps show.

The apps import downwards (nexus_site > gateway > ... > backends > nexus_lib),
so an admin page of ``backends`` cannot ask the gateway what it learned while
serving. The top app plugs the lookups in here when Django starts
(``nexus_site.apps``); in a process that has none, nothing is known.
"""

from __future__ import annotations

from collections.abc import Callable

# (backend, model, its context length now) -> (limit learned from an overflow,
# in Nexus's token estimate; the server's own n_ctx if it said), or None.
LearnedContext = Callable[[str, str, int | None], tuple[int, int | None] | None]

_learned_context: LearnedContext | None = None


def provide_learned_context(lookup: LearnedContext | None) -> None:
    """Where learned_context() asks (None: nowhere)."""
    global _learned_context
    _learned_context = lookup


def learned_context(
    backend: str, model: str, context_length: int | None
) -> tuple[int, int | None] | None:
    """The context limit this process learned for `model` on `backend`."""
    lookup = _learned_context
    return None if lookup is None else lookup(backend, model, context_length)


# backend name -> why this process pauses its cold loads ("": it does not).
ColdLoadPause = Callable[[str], str]

_cold_load_pause: ColdLoadPause | None = None


def provide_cold_load_pause(lookup: ColdLoadPause | None) -> None:
    """Where cold_load_pause() asks (None: nowhere)."""
    global _cold_load_pause
    _cold_load_pause = lookup


def cold_load_pause(backend: str) -> str:
    """Why the serving process pauses new cold loads on `backend` ("": it
    does not, or nothing is known here): repeated out-of-memory load failures
    (every serving process hears of them) or the node's memory pressure."""
    lookup = _cold_load_pause
    return "" if lookup is None else lookup(backend)
