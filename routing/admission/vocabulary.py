"""The words admission control speaks: criticality, flow keys, sizing, outcomes."""

from __future__ import annotations

from enum import IntEnum, StrEnum


class Criticality(IntEnum):
    """How much a request matters when the queue is full (higher wins)."""

    SHEDDABLE = 0
    DEFAULT = 1
    CRITICAL = 2

    @property
    def label(self) -> str:
        """The lower-case name used in headers, settings and metrics."""
        return self.name.lower()

    @classmethod
    def parse(cls, value: str) -> Criticality:
        """Return the level named `value` (any case); raise ValueError if unknown."""
        try:
            return cls[value.strip().upper()]
        except KeyError:
            names = ", ".join(level.label for level in cls)
            raise ValueError(
                f"unknown criticality {value!r}; use one of: {names}"
            ) from None


class FlowKey(StrEnum):
    """What one flow (the unit of fairness) is."""

    MODEL = "model"
    KEY = "key"
    KEY_MODEL = "key+model"


class Sizing(StrEnum):
    """How a request's size (its cost in the fair queue) is estimated."""

    TOKENS = "tokens"
    FIXED = "fixed"


class StockUnit(StrEnum):
    """What the stock and the band count."""

    REQUESTS = "requests"
    TOKENS = "tokens"  # the requests' sizes (estimated tokens)


class Outcome(StrEnum):
    """How a ticket left admission control."""

    BYPASSED = "bypassed"  # went straight through (queue empty, stock low)
    DISPATCHED = "dispatched"  # waited, then went through
    EXPIRED = "expired"  # waited longer than the queue TTL
    DEADLINE = "deadline"  # waited past the client's own deadline
    CANCELLED = "cancelled"  # the client left while waiting
    PREEMPTED = "preempted"  # pushed out by a more critical request
    REJECTED = "rejected"  # refused at the door (queue or flow full)
