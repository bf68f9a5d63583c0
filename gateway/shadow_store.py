"""Shadow comparisons on their way to the database (a service of the gateway).

The proxy's shadow runs (gateway/proxy/shadows.py) add their comparisons
here, a deque append; every couple of seconds a periodic task hands them to
``save`` (``routing.shadow_store.save_comparisons`` through
``database_sync_to_async``, wired by gateway/process.py), off the request
path. Bounded: past ``limit`` waiting rows the oldest are dropped (counted).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

from nexus_lib.service import Periodic, periodic
from routing.core.shadow_compare import ComparisonRow

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 2.0
WAITING_LIMIT = 1000


class ShadowComparisons:
    """Comparisons not yet stored (see the module)."""

    name = "shadow-comparisons"

    def __init__(
        self,
        save: Callable[[list[ComparisonRow]], Awaitable[int]],
        *,
        interval: float = FLUSH_SECONDS,
        limit: int = WAITING_LIMIT,
    ) -> None:
        self._save = save
        self._rows: deque[ComparisonRow] = deque(maxlen=limit)
        self.dropped = 0
        self._periodic: Periodic = periodic(
            "shadow-comparisons-flush",
            interval,
            self.flush,
            error="Could not store shadow comparisons",
            log=logger.warning,
        )

    def add(self, row: ComparisonRow) -> None:
        if len(self._rows) == self._rows.maxlen:
            self.dropped += 1
        self._rows.append(row)

    async def flush(self) -> None:
        """Store what waits (put back in front if the database failed)."""
        rows = list(self._rows)
        if not rows:
            return
        self._rows.clear()
        try:
            await self._save(rows)
        except Exception:
            for row in reversed(rows):
                if len(self._rows) < (self._rows.maxlen or 0):
                    self._rows.appendleft(row)
            raise

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
        try:
            await self.flush()
        except Exception:
            logger.warning("Could not store the last shadow comparisons", exc_info=True)
