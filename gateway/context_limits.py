"""Limits of small-context backend x model pairs, learned from overflows.

Context shift (gateway/proxy/context_shift.py) remembers here, per process,
the limit of a backend x model that overflowed with a context of at most
32,768 tokens, so later requests to that pair are trimmed before they are
sent (pre-trimming). A limit learned is announced on ``CONTEXT_GROUP``
through the channel layer and every serving process listening
(gateway/process.py) applies it, so the others trim before their first
overflow too. Announcing runs off the request path, in a task; the embedded
default's in-memory layer reaches only its own process, which knows already.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)

# Pre-trimming is for small contexts only (the seed's bound): a large model's
# overflow is rare enough to take the round trip.
PRE_TRIM_MAX_CONTEXT = 32_768
CONTEXT_GROUP = "nexus.context"
MESSAGE_TYPE = "context.limit"
PUBLISH_TIMEOUT = 2.0


class ContextLimits:
    """Per process: the limits of backend x model pairs seen to overflow.

    Kept only for contexts of at most ``PRE_TRIM_MAX_CONTEXT`` tokens, with
    the context length the model had then: a different one (discovery saw the
    model reloaded with another ``n_ctx``) forgets the limit.
    """

    __slots__ = ("_limits",)

    def __init__(self) -> None:
        # (backend, model) -> (limit in estimate tokens, context length, n_ctx)
        self._limits: dict[tuple[str, str], tuple[int, int | None, int | None]] = {}

    def remember(
        self,
        backend: str,
        model: str,
        limit: int,
        context_length: int | None,
        n_ctx: int | None,
        *,
        announce: bool = True,
    ) -> None:
        window = n_ctx or context_length
        if window is None or window > PRE_TRIM_MAX_CONTEXT:
            return
        entry = (limit, context_length, n_ctx)
        if self._limits.get((backend, model)) == entry:
            return
        self._limits[(backend, model)] = entry
        if announce:
            self.learned(backend, model, limit, context_length, n_ctx)

    def learned(
        self,
        backend: str,
        model: str,
        limit: int,
        context_length: int | None,
        n_ctx: int | None,
    ) -> None:
        """Hook: a new limit was learned here (shared in gateway.context_limits_sharing)."""

    def limit(self, backend: str, model: str, context_length: int | None) -> int | None:
        """The remembered limit, None if none (or the context changed since)."""
        entry = self._limits.get((backend, model))
        if entry is None:
            return None
        if entry[1] != context_length:
            del self._limits[(backend, model)]
            return None
        return entry[0]

    def peek(
        self, backend: str, model: str, context_length: int | None
    ) -> tuple[int, int | None] | None:
        """(limit, the server's n_ctx) while the context is unchanged, else
        None; changes nothing (the admin reads it from another thread)."""
        entry = self._limits.get((backend, model))
        if entry is None or entry[1] != context_length:
            return None
        return entry[0], entry[2]

    def n_ctx(self, backend: str, model: str) -> int | None:
        """The server's own context size as its overflow said (the admin shows it)."""
        entry = self._limits.get((backend, model))
        return None if entry is None else entry[2]

    def forget(self) -> None:
        self._limits.clear()


class SharedContextLimits(ContextLimits):
    """``ContextLimits`` that tells the other processes what it learns."""

    __slots__ = ("_background", "origin")

    def __init__(self) -> None:
        super().__init__()
        self.origin = secrets.token_hex(8)
        self._background: set[asyncio.Task[None]] = set()

    def learned(
        self,
        backend: str,
        model: str,
        limit: int,
        context_length: int | None,
        n_ctx: int | None,
    ) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        message = {
            "type": MESSAGE_TYPE,
            "origin": self.origin,
            "backend": backend,
            "model": model,
            "limit": limit,
            "context_length": context_length,
            "n_ctx": n_ctx,
        }
        task = loop.create_task(_publish(message))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def on_message(self, message: dict[str, Any]) -> None:
        """Apply another process's limit (a message of CONTEXT_GROUP)."""
        if message.get("type") != MESSAGE_TYPE or message.get("origin") == self.origin:
            return
        limit, context, n_ctx = (
            message.get("limit"),
            message.get("context_length"),
            message.get("n_ctx"),
        )
        numbers_ok = isinstance(limit, int) and limit > 0
        for value in (context, n_ctx):
            numbers_ok = numbers_ok and (value is None or isinstance(value, int))
        backend, model = message.get("backend"), message.get("model")
        if not numbers_ok or not isinstance(backend, str) or not isinstance(model, str):
            logger.warning("Ignoring a malformed context limit message: %r", message)
            return
        self.remember(backend, model, limit, context, n_ctx, announce=False)  # type: ignore[arg-type]


async def _publish(message: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async with asyncio.timeout(PUBLISH_TIMEOUT):
            await layer.group_send(CONTEXT_GROUP, message)
    except Exception:
        logger.warning("Could not announce a context limit", exc_info=True)
