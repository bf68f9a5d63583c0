"""``[routing.context_shift]``: trimming a chat that overflows a model's context.

On by default for the chat surfaces (see gateway/proxy/context_shift.py):
``keep_last_messages`` newest non-system messages are never dropped (at
least 1), and ``max_retries`` trimmed retries go to the backend that
overflowed (retry 1 keeps the tool definitions, retry 2 drops them).
"""

from __future__ import annotations

from dataclasses import dataclass

KEEP_LAST_LIMIT = 1000
RETRIES_LIMIT = 5


@dataclass(frozen=True, slots=True)
class ContextShiftPolicy:
    """Whether context shift runs, what it keeps, and how often it retries."""

    enabled: bool = True
    keep_last_messages: int = 1
    max_retries: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.keep_last_messages <= KEEP_LAST_LIMIT:
            raise ValueError(
                f"keep_last_messages must be within 1..{KEEP_LAST_LIMIT}, "
                f"got {self.keep_last_messages}"
            )
        if not 0 <= self.max_retries <= RETRIES_LIMIT:
            raise ValueError(
                f"context shift max_retries must be within 0..{RETRIES_LIMIT}, "
                f"got {self.max_retries}"
            )
