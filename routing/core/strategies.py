"""The ways to pick one candidate, and the order to retry the others in.

Every function works on candidates in the snapshot's stable order (backend
priority, then name) and returns indexes into that sequence.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from routing.core.vocabulary import Strategy


def pick_smart(totals: Sequence[float]) -> int:
    """Return the index of the highest score; the first one wins ties."""
    return totals.index(max(totals))


# Backends of this kind (relay workers) share a tie in turn (see pick_rotating).
RELAY_KIND = "relay"


def pick_rotating(index: int, tied: Sequence[int], turn: int) -> int:
    """Return `index`, or, when it is among `tied` (more than one), the tied
    candidate whose turn it is: least-loaded dispatch among equal workers
    with round-robin ties, as the relay seed's dispatcher does."""
    if len(tied) > 1 and index in tied:
        return tied[turn % len(tied)]
    return index


def pick_round_robin(count: int, turn: int) -> int:
    """Return the candidate whose turn it is."""
    return turn % count


def pick_priority_only(priorities: Sequence[int], turn: int) -> int:
    """Return a candidate with the lowest priority number, rotating among ties."""
    lowest = min(priorities)
    tied = [index for index, priority in enumerate(priorities) if priority == lowest]
    return tied[turn % len(tied)]


def pick_random(count: int, rng: random.Random) -> int:
    """Return a uniformly random candidate."""
    return rng.randrange(count)


def order_retries(
    strategy: Strategy,
    chosen: int,
    *,
    totals: Sequence[float],
    priorities: Sequence[int],
) -> list[int]:
    """Return the other candidates' indexes in the order the strategy would pick.

    smart and fleet: by score, best first (the earlier candidate on ties); priority_only:
    by priority, continuing the rotation among equals; round_robin and random:
    continuing the rotation after the chosen one.
    """
    count = len(priorities)
    rotation = [(chosen + step) % count for step in range(1, count)]
    if strategy is Strategy.SMART or strategy is Strategy.FLEET:
        return sorted(rotation, key=lambda i: (-totals[i], i))
    if strategy is Strategy.PRIORITY_ONLY:
        return sorted(rotation, key=lambda i: priorities[i])
    return rotation
