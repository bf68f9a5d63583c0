"""The response cache of one serving process: look up, keep, purge, count.

``ResponseCache`` is the gateway's (gateway/process.py): the proxy asks it
for an entry by key (``fetch``) and hands it answers to keep once they are
complete (``keep``, before the answer's last byte goes out: the client's
next request finds it; one round trip to Redis, within its timeout). A store that fails (Redis down or slow) never fails a request: the
lookup is a miss, the answer is not kept, the failure is counted
(``nexus_cache_errors``) and logged at most once a minute.

With Redis, the entries this process read from it lately are kept in its
memory too (``NEXUS_CACHE_MEMORY_MAX_BYTES``, least recently used out
first), each until the time it expires in Redis: a repeated hit costs no
round trip. What a process keeps is only what Redis gave it, so with Redis
down nothing is served from the cache.

Purges are recorded in the routing policy (routing/cache_purge.py), so every
serving process stops serving what they cover as soon as it routes with the
new configuration (``CachePolicy.is_purged``); when it does, this process
also drops the entries from its store (Redis: whichever process gets there
first deletes them, the others find nothing left).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from gateway.cache.entries import Entry
from gateway.cache.stores import MemoryStore, RedisStore, Store
from routing.core.cache_policy import SCOPE_SHARED, CachePolicy

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

# Failures are logged at most once per this many seconds.
LOG_INTERVAL = 60.0
# Errors a store may raise: Redis's, the socket's, Redis's silence.
STORE_ERRORS = (RedisError, OSError, TimeoutError, ValueError)
SHARED_TAG = "shared"


def tag(text: str) -> str:
    """A short fixed-length tag of a model's or a key's name for entry keys."""
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def scope_of(policy: CachePolicy, key_prefix: str) -> str:
    """Whose answers a request may share: its key's prefix, or "" (shared)."""
    return "" if policy.scope == SCOPE_SHARED else key_prefix


def entry_key(model: str, scope: str, digest: str) -> str:
    """The store's key of an entry: model tag, scope tag, request digest."""
    return f"{tag(model)}:{tag(scope) if scope else SHARED_TAG}:{digest}"


class ResponseCache:
    """One process's way to the cache's store (see the module docstring)."""

    name = "response-cache"

    def __init__(
        self, store: Store, metrics: GatewayMetrics, local: MemoryStore | None = None
    ) -> None:
        self.store = store
        # In front of a shared store: the entries this process read from it
        # lately (an LRU in memory), answered without a round trip until
        # they expire or a purge covers them.
        self.local = local
        self.metrics = metrics
        lookups = metrics.cache_lookups
        self.hits = lookups.labels("hit")
        self.misses = lookups.labels("miss")
        self.bypasses = lookups.labels("bypass")
        stores = metrics.cache_stores
        self.stored = stores.labels("stored")
        self.too_large = stores.labels("too_large")
        self.store_failed = stores.labels("failed")
        self._pending: set[asyncio.Task[None]] = set()
        self._logged_at = -LOG_INTERVAL
        self._unlogged = 0
        self._purges_seen: CachePolicy | None = None

    @classmethod
    def from_settings(
        cls,
        metrics: GatewayMetrics,
        redis_url: str,
        redis_max_bytes: int,
        memory_max_bytes: int,
        timeout: float,
    ) -> ResponseCache:
        if redis_url:
            redis = RedisStore(redis_url, redis_max_bytes, timeout)
            return cls(redis, metrics, MemoryStore(memory_max_bytes))
        return cls(MemoryStore(memory_max_bytes), metrics)

    def start(self) -> None:
        """Nothing to start: the store connects on first use."""

    async def stop(self) -> None:
        pending = list(self._pending)
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        for task in pending:
            task.cancel()
        await self.store.close()

    async def fetch(self, key: str) -> Entry | None:
        """The entry stored under `key`, or None (not there, or the store
        failed: counted and logged). This process's recent entries first."""
        local = self.local
        if local is not None:
            data = local.get_now(key)
            if data is not None:
                return Entry.decode(data)
        try:
            data = await self.store.get(key)
        except STORE_ERRORS as error:
            self._failed("look up an answer", error)
            return None
        if data is None:
            return None
        entry = Entry.decode(data)
        if entry is not None and local is not None:
            left = entry.expires_at - time.time()
            if left > 0:
                local.put_now(key, data, left)
        return entry

    async def keep(self, key: str, entry: Entry, ttl: float, max_bytes: int) -> None:
        """Store the answer (unless too large); a failure is counted, logged
        and otherwise ignored."""
        if len(entry.reply) > max_bytes:
            self.too_large.inc()
            return
        try:
            await self.store.put(key, entry.encode(), ttl)
        except STORE_ERRORS as error:
            self.store_failed.inc()
            self._failed("store an answer", error)
            return
        self.stored.inc()

    def note_policy(self, policy: CachePolicy) -> None:
        """Drop from the store what a purge new to this process covers."""
        seen, self._purges_seen = self._purges_seen, policy
        if seen is None:
            return
        purges: list[tuple[str, str]] = []
        if policy.purged_all > seen.purged_all:
            purges.append(("", ""))
        else:
            for model, when in policy.purged_models.items():
                if when > seen.purged_models.get(model, 0.0):
                    purges.append((tag(model), ""))
            for prefix, when in policy.purged_keys.items():
                if when > seen.purged_keys.get(prefix, 0.0):
                    purges.append(("", tag(prefix)))
        if purges:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # not serving yet: nothing stored here to drop
            task = loop.create_task(self._purge(purges))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _purge(self, purges: list[tuple[str, str]]) -> None:
        for model_tag, scope_tag in purges:
            if self.local is not None:
                self.local.purge_now(model_tag, scope_tag)
            try:
                await self.store.purge(model_tag, scope_tag)
            except STORE_ERRORS as error:
                self._failed("purge answers", error)

    def _failed(self, what: str, error: BaseException) -> None:
        self.metrics.cache_errors.inc()
        now = time.monotonic()
        if now - self._logged_at < LOG_INTERVAL:
            self._unlogged += 1
            return
        left_out, self._unlogged = self._unlogged, 0
        self._logged_at = now
        logger.warning(
            "The response cache could not %s (%s: %s); served uncached%s",
            what,
            type(error).__name__,
            error,
            f" ({left_out} more failures since the last line)" if left_out else "",
        )
