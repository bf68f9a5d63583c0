"""Where cached answers are kept: in this process, or in Redis for all.

``MemoryStore`` (the embedded default) is an LRU bounded in bytes. In
production ``RedisStore`` keeps them in Redis, shared by every serving
process, under keys of their own (``nexus:{cache}:...``) with their TTL and a
byte cap of their own that the store enforces: Redis's ``maxmemory`` policy
is the whole server's (the Celery broker and the channel layer live there
too), so entries are evicted by the store, least recently used first, once
their bytes pass ``NEXUS_CACHE_REDIS_MAX_BYTES``: a sorted set orders them by
last use, a hash holds each one's size and a counter their sum (one Lua
script stores and evicts atomically). An expired entry's bytes count until
its turn to be evicted comes: it is among the least recently used.

Every store is asked with an entry's full key: ``<model tag>:<scope
tag>:<request digest>`` (gateway/cache/service.py), so purges by model or by
key match the key's head. Nothing here raises for a miss; a store that
fails raises, and the caller counts and serves uncached.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Protocol

from redis.exceptions import RedisError

from routing.core.cache_policy import ENTRY_BYTES_LIMIT
from usage.limits.resp import RespConnection, Script, encode

PREFIX = "nexus:{cache}:"
_LRU = PREFIX + "lru"
_SIZES = PREFIX + "sizes"
_BYTES = PREFIX + "bytes"
_ENTRY = PREFIX + "e:"
# Per-entry bookkeeping counted with its bytes (the sorted set, the hash).
ENTRY_OVERHEAD = 128

_STORE = Script(
    """
local entry, lru, sizes, total = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local size = string.len(ARGV[1]) + tonumber(ARGV[5])
local old = redis.call('HGET', sizes, entry)
if old then redis.call('DECRBY', total, old) end
redis.call('SET', entry, ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', lru, ARGV[3], entry)
redis.call('HSET', sizes, entry, size)
local bytes = redis.call('INCRBY', total, size)
local cap = tonumber(ARGV[4])
local evicted = 0
while bytes > cap do
  local oldest = redis.call('ZRANGE', lru, 0, 0)
  if #oldest == 0 then break end
  local victim = oldest[1]
  local freed = tonumber(redis.call('HGET', sizes, victim) or '0')
  redis.call('ZREM', lru, victim)
  redis.call('HDEL', sizes, victim)
  redis.call('DEL', victim)
  bytes = redis.call('DECRBY', total, freed)
  evicted = evicted + 1
end
return evicted
"""
)
_FORGET = Script(
    """
local lru, sizes, total = KEYS[1], KEYS[2], KEYS[3]
local freed = 0
for i = 4, #KEYS do
  local size = redis.call('HGET', sizes, KEYS[i])
  if size then
    freed = freed + tonumber(size)
    redis.call('HDEL', sizes, KEYS[i])
  end
  redis.call('ZREM', lru, KEYS[i])
  redis.call('DEL', KEYS[i])
end
if freed > 0 then redis.call('DECRBY', total, freed) end
return #KEYS - 3
"""
)


class Store(Protocol):
    """A place for entries (see the module docstring)."""

    name: str

    async def get(self, key: str) -> bytes | None: ...
    async def put(self, key: str, value: bytes, ttl: float) -> None: ...
    async def purge(self, pattern_head: str, scope_tag: str) -> int: ...
    async def close(self) -> None: ...


class MemoryStore:
    """An LRU of entries in this process, bounded in bytes (keys included)."""

    name = "memory"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._now = time.monotonic
        # key -> (expires at, value)
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> bytes | None:
        return self.get_now(key)

    def get_now(self, key: str) -> bytes | None:
        found = self._entries.get(key)
        if found is None:
            return None
        expires, value = found
        if expires <= self._now():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return value

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        self.put_now(key, value, ttl)

    def put_now(self, key: str, value: bytes, ttl: float) -> None:
        size = len(key) + len(value) + ENTRY_OVERHEAD
        if size > self.max_bytes:
            return
        if key in self._entries:
            self._remove(key)
        self._entries[key] = (self._now() + ttl, value)
        self.bytes += size
        while self.bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._remove(oldest)

    async def purge(self, model_tag: str, scope_tag: str) -> int:
        return self.purge_now(model_tag, scope_tag)

    def purge_now(self, model_tag: str, scope_tag: str) -> int:
        """Drop the entries of a model and/or a scope ("": any); return how many."""
        doomed = [key for key in self._entries if _matches(key, model_tag, scope_tag)]
        for key in doomed:
            self._remove(key)
        return len(doomed)

    async def close(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _remove(self, key: str) -> None:
        _, value = self._entries.pop(key)
        self.bytes -= len(key) + len(value) + ENTRY_OVERHEAD


class RedisStore:
    """Entries in Redis, shared by every serving process (see the module)."""

    name = "redis"

    def __init__(self, url: str, max_bytes: int, timeout: float) -> None:
        self.max_bytes = max_bytes
        # Replies as large as the largest entry allowed, and some.
        self.redis = RespConnection(
            url, timeout, max_reply=ENTRY_BYTES_LIMIT + (1 << 16)
        )

    async def get(self, key: str) -> bytes | None:
        entry = _ENTRY + key
        now_ms = int(time.time() * 1000)
        # The use is noted in the same write, unanswered (CLIENT REPLY SKIP);
        # XX: a key that is not there is not added.
        touch = encode(("CLIENT", "REPLY", "SKIP")) + encode(
            ("ZADD", _LRU, "XX", now_ms, entry)
        )
        reply = await self.redis.request(encode(("GET", entry)), before=touch)
        if reply is None or isinstance(reply, bytes):
            return reply
        raise RedisError(f"unexpected reply to GET: {type(reply).__name__}")

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        await self.redis.run(
            _STORE,
            [_ENTRY + key, _LRU, _SIZES, _BYTES],
            [
                value,
                max(int(ttl * 1000), 1),
                int(time.time() * 1000),
                self.max_bytes,
                ENTRY_OVERHEAD,
            ],
        )

    async def purge(self, model_tag: str, scope_tag: str) -> int:
        """Delete the entries of a model and/or a scope ("": any), by SCAN."""
        pattern = f"{_ENTRY}{model_tag or '*'}:{scope_tag or '*'}:*"
        cursor = b"0"
        deleted = 0
        while True:
            reply = await self.redis.call(
                "SCAN", cursor, "MATCH", pattern, "COUNT", 500
            )
            if not isinstance(reply, list) or len(reply) != 2:
                raise RedisError(f"unexpected reply to SCAN: {reply!r:.100}")
            cursor, keys = reply
            if keys:
                count = await self.redis.run(_FORGET, [_LRU, _SIZES, _BYTES, *keys], [])
                deleted += int(count) if isinstance(count, int) else 0
            if cursor in (b"0", 0, "0"):
                return deleted

    async def used_bytes(self) -> int:
        reply = await self.redis.call("GET", _BYTES)
        return int(reply) if isinstance(reply, bytes) else 0

    async def close(self) -> None:
        await self.redis.close()


def _matches(key: str, model_tag: str, scope_tag: str) -> bool:
    model, _, rest = key.partition(":")
    scope = rest.partition(":")[0]
    return (not model_tag or model == model_tag) and (
        not scope_tag or scope == scope_tag
    )
