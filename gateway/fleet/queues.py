"""Per backend x model waiting lines, and the slots they wait for (pure).

A request whose chosen backend has no free slot joins the line of that
backend x model. Slots belong to the backend (``max_concurrency``) and, where
set, to the model on it (its own ``max_concurrency``). When a request on a
backend finishes, the oldest waiter on that backend whose model has a free
slot gets it: FIFO per line, oldest first across the backend's lines.

A slot handed to a waiter is *reserved* until the waiter's task runs and
counts itself in flight, so that a request arriving in between cannot take
it. Nothing here knows about asyncio: the glue keeps a future in each waiter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

Key = tuple[str, str]  # (backend name, model name)


@dataclass(eq=False, slots=True)
class Waiter:
    """One request waiting for a slot on ``backend`` to run ``model``."""

    backend: str
    model: str
    joined_at: float
    # The glue's handle (a future resolved with the slot it gets).
    handle: Any = field(default=None, repr=False)
    # The gateway-wide lease of the slot, when the request that ended handed
    # it over (a shared limiter): taken as it is, not released and acquired.
    lease: str | None = field(default=None, repr=False)


def has_free_slot(in_flight: int, reserved: int, capacity: int) -> bool:
    """Whether one more request fits under `capacity` (in flight + reserved)."""
    return in_flight + reserved < capacity


class FleetQueues:
    """Every waiting line of one process, and the slots reserved for waiters."""

    def __init__(self) -> None:
        # backend -> model -> waiters in arrival order
        self._lines: dict[str, dict[str, deque[Waiter]]] = {}
        self._reserved: dict[str, int] = {}
        self._reserved_models: dict[Key, int] = {}

    # Lines ------------------------------------------------------------------

    def join(self, waiter: Waiter, max_length: int) -> bool:
        """Put `waiter` at the end of its line; False if the line is full."""
        lines = self._lines.setdefault(waiter.backend, {})
        line = lines.get(waiter.model)
        if line is None:
            line = lines[waiter.model] = deque()
        if len(line) >= max_length:
            if not line:
                del lines[waiter.model]
            return False
        line.append(waiter)
        return True

    def leave(self, waiter: Waiter) -> bool:
        """Take `waiter` out of its line; False if it was not in one."""
        lines = self._lines.get(waiter.backend)
        line = lines.get(waiter.model) if lines is not None else None
        if line is None:
            return False
        try:
            line.remove(waiter)
        except ValueError:
            return False
        self._forget_empty(waiter.backend, waiter.model)
        return True

    def waiting(self, backend: str, model: str) -> int:
        """How many requests wait for `model` on `backend`."""
        lines = self._lines.get(backend)
        line = lines.get(model) if lines is not None else None
        return len(line) if line is not None else 0

    def waiting_on(self, backend: str) -> int:
        """How many requests wait for any model on `backend`."""
        return sum(len(line) for line in self._lines.get(backend, {}).values())

    def lines(self) -> Iterator[tuple[str, str, int]]:
        """Every non-empty line as (backend, model, length)."""
        for backend, lines in self._lines.items():
            for model, line in lines.items():
                yield backend, model, len(line)

    @property
    def total_waiting(self) -> int:
        """Requests waiting in every line."""
        return sum(length for _, _, length in self.lines())

    def pop_next(self, backend: str, can_take: Callable[[str], bool]) -> Waiter | None:
        """Remove and return the oldest waiter on `backend` whose model can
        take a slot now (``can_take(model)``), or None."""
        best: Waiter | None = None
        for model, line in self._lines.get(backend, {}).items():
            head = line[0]
            if (best is None or head.joined_at < best.joined_at) and can_take(model):
                best = head
        if best is not None:
            self._lines[backend][best.model].popleft()
            self._forget_empty(backend, best.model)
        return best

    def pop_oldest(self, backend: str, model: str, count: int) -> list[Waiter]:
        """Remove and return up to `count` of the line's oldest waiters."""
        lines = self._lines.get(backend)
        line = lines.get(model) if lines is not None else None
        taken: list[Waiter] = []
        while line and len(taken) < count:
            taken.append(line.popleft())
        self._forget_empty(backend, model)
        return taken

    # Reserved slots -----------------------------------------------------------

    def reserve(self, backend: str, model: str) -> None:
        """Hold a slot on `backend` for `model` for a waiter about to run."""
        self._reserved[backend] = self._reserved.get(backend, 0) + 1
        key = (backend, model)
        self._reserved_models[key] = self._reserved_models.get(key, 0) + 1

    def unreserve(self, backend: str, model: str) -> None:
        """Give back a slot reserved with ``reserve`` (taken or not)."""
        count = self._reserved.get(backend, 0) - 1
        if count > 0:
            self._reserved[backend] = count
        else:
            self._reserved.pop(backend, None)
        key = (backend, model)
        count = self._reserved_models.get(key, 0) - 1
        if count > 0:
            self._reserved_models[key] = count
        else:
            self._reserved_models.pop(key, None)

    def reserved(self, backend: str) -> int:
        """Slots held for waiters on `backend`."""
        return self._reserved.get(backend, 0)

    def reserved_for(self, backend: str, model: str) -> int:
        """Slots held for waiters for `model` on `backend`."""
        return self._reserved_models.get((backend, model), 0)

    def _forget_empty(self, backend: str, model: str) -> None:
        lines = self._lines.get(backend)
        if lines is None:
            return
        line = lines.get(model)
        if line is not None and not line:
            del lines[model]
        if not lines:
            del self._lines[backend]
