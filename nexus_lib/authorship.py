"""Who is changing the configuration, for the configuration history.

The layers that start work set it: the admin and API middleware (the user or
admin token), management commands (``DatabaseCommand``), Celery tasks. The
history (routing/history) reads it when it records a version, so an app low in
the layers can name the author of its changes without importing routing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass

# What made a change: one of these words, shown beside the author.
VIA_ADMIN = "admin"
VIA_API = "api"
VIA_IMPORT = "import"
VIA_COMMAND = "command"
VIA_TASK = "task"
VIA_REVERT = "revert"
VIA_SYSTEM = "system"


@dataclass(frozen=True)
class ChangeAuthor:
    """Who changed the configuration (a user, an admin token, ``import``) and
    through what."""

    name: str
    via: str


SYSTEM = ChangeAuthor("system", VIA_SYSTEM)

_author: ContextVar[ChangeAuthor | None] = ContextVar(
    "nexus_change_author", default=None
)


@contextmanager
def acting_as(author: ChangeAuthor) -> Iterator[ChangeAuthor]:
    """Attribute the configuration changes made inside this block to ``author``."""
    token = _author.set(author)
    try:
        yield author
    finally:
        _author.reset(token)


def start_acting_as(author: ChangeAuthor) -> Token[ChangeAuthor | None]:
    """``acting_as()`` for hooks that start and end in separate calls (Celery's
    task signals); end with ``stop_acting_as(token)``."""
    return _author.set(author)


def stop_acting_as(token: Token[ChangeAuthor | None]) -> None:
    _author.reset(token)


def current_author() -> ChangeAuthor:
    """Who the changes made now are attributed to (``system`` when nobody)."""
    return _author.get() or SYSTEM
