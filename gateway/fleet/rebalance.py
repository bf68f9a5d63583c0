"""Which waiting requests to move to another backend, and where (pure).

Every cycle the glue describes each waiting line (its backend, model, in
flight and waiting) and every place where a model is hot with a free slot.
A line deeper than the threshold (in flight + waiting) gives its oldest
waiters to hot places of the same model on other backends, deepest line
first, at most ``max_moves`` per cycle so that requests do not oscillate.
Only hot places are offered, so a move never causes a cold load; requests in
flight are never moved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LineLoad:
    """One backend x model line as the rebalancer sees it."""

    backend: str
    model: str
    in_flight: int
    waiting: int

    @property
    def depth(self) -> int:
        """In flight + waiting: what the queue penalty and thresholds count."""
        return self.in_flight + self.waiting


@dataclass(frozen=True, slots=True)
class Opening:
    """A backend where `model` is hot and `free` more requests fit now."""

    backend: str
    model: str
    free: int


@dataclass(frozen=True, slots=True)
class Move:
    """Move one waiting request for `model` from `source` to `destination`."""

    source: str
    destination: str
    model: str


def plan_rebalance(
    lines: Iterable[LineLoad],
    openings: Iterable[Opening],
    *,
    threshold: int,
    max_moves: int,
) -> list[Move]:
    """Return the moves of one cycle (at most `max_moves`).

    A line is drained while it is deeper than `threshold`, has waiters, and a
    hot opening of its model on another backend has room; each move takes one
    slot of the opening.
    """
    free: dict[tuple[str, str], int] = {}
    for opening in openings:
        if opening.free > 0:
            key = (opening.backend, opening.model)
            free[key] = free.get(key, 0) + opening.free
    moves: list[Move] = []
    ordered = sorted(lines, key=lambda line: (-line.depth, line.backend, line.model))
    for line in ordered:
        depth, waiting = line.depth, line.waiting
        for (backend, model), room in sorted(free.items()):
            if model != line.model or backend == line.backend:
                continue
            while (
                room > 0
                and waiting > 0
                and depth > threshold
                and len(moves) < max_moves
            ):
                moves.append(Move(line.backend, backend, model))
                room -= 1
                waiting -= 1
                depth -= 1
            free[(backend, model)] = room
        if len(moves) >= max_moves:
            break
    return moves
