"""Splits, shadows and hedging: how a model's traffic is shared, mirrored, raced.

``[routing.splits."chat"]`` shares a client-facing name over several models
by weight. A request's side is chosen by hashing the split's name with the
client key (``sticky = "key"``): no state, so every serving process puts a key
on the same side, and a key keeps its side while the split's targets and
weights stay the same (a side's share grown moves only the keys in the new
share). ``sticky = "request"`` draws a side for every request. Each side is
then routed as if the client had asked for that model: its own aliases and
fallback chain, never the other side's.

``[routing.shadows."<model>"]`` mirrors a share of the requests served by a
model to another one, for comparison only (gateway/shadows.py).

``[routing.hedging."<model>"]`` starts a second attempt at the next-best
backend when the first has produced no byte after a delay (gateway/proxy/
hedging.py).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

STICKY_KEY = "key"
STICKY_REQUEST = "request"
STICKY_CHOICES = (STICKY_KEY, STICKY_REQUEST)
WEIGHT_LIMIT = 1_000_000
SIDES_LIMIT = 16
HEDGE_AFTER_FIXED = "fixed"
HEDGE_AFTER_P95 = "p95"
HEDGE_AFTER_CHOICES = (HEDGE_AFTER_FIXED, HEDGE_AFTER_P95)
HEDGE_EXTRA_LIMIT = 3
HEDGE_AFTER_MS_LIMIT = 600_000
# A 64-bit hash point; sides own consecutive ranges of it.
_POINTS = 1 << 64


@dataclass(frozen=True, slots=True)
class SplitSide:
    """One side of a split: the model it routes to and its weight."""

    model: str
    weight: int


@dataclass(frozen=True, slots=True)
class SplitChoice:
    """The side a request was put on, and why."""

    split: str
    side: str
    sticky: str
    # The hash point (0..1) a sticky key landed on; None for a random draw.
    point: float | None = None

    def as_dict(self) -> dict[str, object]:
        """Return a JSON-serialisable description of the choice."""
        return {
            "split": self.split,
            "side": self.side,
            "sticky": self.sticky,
            "point": self.point,
        }


@dataclass(frozen=True, slots=True)
class Split:
    """A client-facing model name shared over several models by weight."""

    name: str
    sides: tuple[SplitSide, ...]
    sticky: str = STICKY_KEY

    def __post_init__(self) -> None:
        problem = split_problem(self.name, self.sides, self.sticky)
        if problem is not None:
            raise ValueError(problem)

    @property
    def total_weight(self) -> int:
        return sum(side.weight for side in self.sides)

    def choose(self, key: str, rng: random.Random) -> SplitChoice:
        """Put a request on a side: by the key's hash when sticky per key and
        a key is known, else by a random draw weighted like the hash."""
        if self.sticky == STICKY_KEY and key:
            point = hash_point(self.name, key)
            return SplitChoice(self.name, self.side_at(point), self.sticky, point)
        return SplitChoice(self.name, self.side_at(rng.random()), self.sticky)

    def side_at(self, point: float) -> str:
        """The side owning ``point`` (0 <= point < 1), sides in their order."""
        threshold = point * self.total_weight
        reached = 0
        for side in self.sides:
            reached += side.weight
            if threshold < reached:
                return side.model
        return self.sides[-1].model


def hash_point(split: str, key: str) -> float:
    """A key's stable place (0 <= p < 1) in a split: the same in every process."""
    digest = hashlib.blake2b(
        f"{split}\x00{key}".encode(), digest_size=8, person=b"nexus-split"
    ).digest()
    return int.from_bytes(digest, "big") / _POINTS


def split_problem(name: str, sides: Sequence[SplitSide], sticky: str) -> str | None:
    """What is wrong with a split's shape, or None."""
    if not sides:
        return f"split {name!r} needs at least one target"
    if len(sides) > SIDES_LIMIT:
        return f"split {name!r} has more than {SIDES_LIMIT} targets"
    if sticky not in STICKY_CHOICES:
        return f"sticky must be 'key' or 'request', not {sticky!r}"
    seen: set[str] = set()
    for side in sides:
        if side.model == name:
            return f"split {name!r} cannot target itself"
        if side.model in seen:
            return f"split {name!r} lists {side.model!r} twice"
        seen.add(side.model)
        if not 0 < side.weight <= WEIGHT_LIMIT:
            return (
                f"the weight of {side.model!r} must be a whole number from 1 to "
                f"{WEIGHT_LIMIT}, got {side.weight}"
            )
    return None


@dataclass(frozen=True, slots=True)
class ShadowPolicy:
    """Mirror ``percent`` of a model's requests to ``shadow`` for comparison."""

    model: str
    shadow: str
    percent: float
    timeout_seconds: float = 30.0
    keep: int = 50
    max_answer_chars: int = 16_384

    def is_picked(self, draw: float) -> bool:
        """Whether a request with a uniform draw in [0, 1) is mirrored."""
        return draw * 100 < self.percent


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    """When a model's requests get a second attempt, and how many extra."""

    model: str
    after: str = HEDGE_AFTER_FIXED
    # The fixed delay; with ``after = "p95"`` the delay until enough first
    # bytes were seen to know the p95.
    after_ms: int = 250
    max_extra: int = 1
    # Bodies larger than this are never hedged (their prompt is costly twice).
    max_body_bytes: int = 65_536

    def __post_init__(self) -> None:
        if self.after not in HEDGE_AFTER_CHOICES:
            raise ValueError(f"after must be 'fixed' or 'p95', not {self.after!r}")
        if not 1 <= self.max_extra <= HEDGE_EXTRA_LIMIT:
            raise ValueError(f"max_extra must be within 1..{HEDGE_EXTRA_LIMIT}")
        if not 0 <= self.after_ms <= HEDGE_AFTER_MS_LIMIT:
            raise ValueError(f"after_ms must be within 0..{HEDGE_AFTER_MS_LIMIT}")
