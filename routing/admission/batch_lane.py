"""The batch lane: batch lines waiting behind every interactive request.

Batch jobs (the OpenAI Batches and Anthropic Message Batches APIs) send their
lines through the normal pipeline at a band below sheddable. A batch line
never enters the fair queue, so it never takes an interactive request's
place, share or queue capacity: it waits in its pool's lane, first in first
out, and goes only while no interactive request waits in the pool and the
pool's stock is below the batch limit (``batch_limit``: the band's dispatch
limit less a headroom kept free for interactive arrivals). The batch thus
slows down as interactive traffic rises and speeds up as it falls.

Lines wait at most the queue TTL (then expire; the batch runner sends them
again later); the lane holds at most what the runners send at once (their
concurrency is bounded per batch and per key).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from routing.admission.queue import Ticket
from routing.admission.settings import NO_LIMIT, Band


class BatchLane:
    """Batch tickets waiting for a pool, in arrival order."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: dict[Ticket, None] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def push(self, ticket: Ticket, now: float) -> None:
        """Add `ticket` at the end of the lane."""
        ticket.arrived = now
        ticket.queued = True
        self._waiting[ticket] = None

    def pop(self) -> Ticket | None:
        """Take the oldest ticket (None when empty)."""
        for ticket in self._waiting:
            del self._waiting[ticket]
            ticket.queued = False
            return ticket
        return None

    def remove(self, ticket: Ticket) -> bool:
        """Take `ticket` out (its line was cancelled); False if not here."""
        if self._waiting.pop(ticket, False) is None:
            ticket.queued = False
            return True
        return False

    def expire(self, now: float, ttl: float) -> list[Ticket]:
        """Take the tickets that waited `ttl` seconds or more, oldest first."""
        expired: list[Ticket] = []
        for ticket in self._waiting:
            if ticket.arrived + ttl > now:
                break
            expired.append(ticket)
        for ticket in expired:
            del self._waiting[ticket]
            ticket.queued = False
        return expired

    def next_expiry(self, ttl: float) -> float | None:
        """When the oldest ticket expires (None when empty)."""
        for ticket in self._waiting:
            return ticket.arrived + ttl
        return None

    def waiting(self) -> Iterator[Ticket]:
        yield from self._waiting


def batch_limit(limit: int, headroom: float) -> int:
    """The stock below which a batch line may go: `limit` less the headroom
    (a fraction of it, at least one request), never below one (or a pool of
    one slot would never run a batch)."""
    if limit >= NO_LIMIT:
        return limit
    kept = max(1, math.ceil(limit * headroom - 1e-9)) if headroom > 0 else 0
    return max(1, limit - kept)


def has_batch_room(band: Band, headroom: float, stock: int, tokens: float) -> bool:
    """Whether a pool with this stock may let a batch line through now."""
    return stock < batch_limit(band.dispatch_limit, headroom) and tokens < batch_limit(
        band.token_dispatch_limit, headroom
    )
