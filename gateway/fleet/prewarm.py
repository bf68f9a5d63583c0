"""When to load a model on the runner-up before the overflow arrives (pure).

After a decision, if the winner's depth (in flight + waiting) exceeds the
pre-warm threshold, the model is loaded on the runner-up unless it is hot
there already, a warm-up of that model on that backend is under way (the
lock), or one succeeded recently (the snapshot has not learned it yet).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.fleet.queues import Key


class PrewarmBook:
    """The warm-ups under way and those done recently, per (backend, model)."""

    def __init__(self, clock: Callable[[], float], remember_seconds: float) -> None:
        self._clock = clock
        self._remember = remember_seconds
        self._running: set[Key] = set()
        self._done: dict[Key, float] = {}

    def should_warm(
        self, depth: int, threshold: int, backend: str, model: str, is_hot: bool
    ) -> bool:
        """Whether to warm `model` on `backend` now (then call ``begin``)."""
        if depth <= threshold or is_hot:
            return False
        key = (backend, model)
        if key in self._running:
            return False
        done = self._done.get(key)
        return done is None or self._clock() - done >= self._remember

    def begin(self, backend: str, model: str) -> None:
        """Take the lock of (backend, model)."""
        self._running.add((backend, model))

    def finish(self, backend: str, model: str, *, loaded: bool) -> None:
        """Release the lock; remember a success for a while."""
        key = (backend, model)
        self._running.discard(key)
        now = self._clock()
        for old in [k for k, at in self._done.items() if now - at >= self._remember]:
            del self._done[old]
        if loaded:
            self._done[key] = now

    def is_running(self, backend: str, model: str) -> bool:
        """Whether a warm-up of `model` on `backend` is under way."""
        return (backend, model) in self._running
