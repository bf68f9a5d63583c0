"""Usage events through a Redis stream: serving processes append, Celery writes.

In production a serving process does no database writes for usage: its
gateway's ``RedisShipper`` moves the in-process buffer to the ``nexus:usage``
Redis stream every few tens of milliseconds (one pipelined round trip per
batch), so a process killed without warning loses at most that much. The
Celery worker's ``drain_usage_stream()`` (beat, about once a second, and
``manage.py nexus_flush_usage``) writes what the stream holds with
``flush_usage()`` and only then deletes those entries. Two drains running at
once write the same events twice, which the unique ``event_id`` turns into
once, so no lock is needed for exactness.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from django.conf import settings
from redis.backoff import NoBackoff

from nexus_lib.service import periodic
from usage.buffer import (
    UsageBuffer,
    UsageEvent,
    UsageItem,
    decode_events,
    encode_events,
)
from usage.flush import flush_usage, keep_on_disk
from usage.spill import UsageSpill, replay_spilled, spill_excess

logger = logging.getLogger(__name__)

STREAM_KEY = "nexus:usage"
# Redis keeps at most about this many undrained batches (the Celery worker
# down for a long time); the oldest go first. A batch is one shipment of one
# process: a handful of events, up to SHIP_BATCH under heavy load.
STREAM_MAX_ENTRIES = 200_000
SHIP_BATCH = 1000
DRAIN_BATCH = 1000
# During a Redis outage, log the failure once per this many attempts.
_LOG_EVERY = 200
# The shipper retries on its own (every second, spilling meanwhile): redis-py's
# own retries (3, backing off up to 10 s, since redis-py 6) only held a failed
# shipment, and a stop behind it, for half a minute.
_NO_RETRY = redis.retry.Retry(NoBackoff(), 0)
_NO_RETRY_ASYNC = redis.asyncio.retry.Retry(NoBackoff(), 0)


def _add_batch(pipe: Any, events: list[UsageItem]) -> None:
    # One entry per batch: one command and one JSON document however many
    # events a shipment holds.
    pipe.xadd(
        STREAM_KEY,
        {"b": encode_events(events)},
        maxlen=STREAM_MAX_ENTRIES,
        approximate=True,
    )


class RedisShipper:
    """Moves one buffer to the Redis stream, in a task of the serving process.

    A service (nexus_lib.service), as ``DatabaseFlusher``.
    """

    name = "usage-shipper"

    def __init__(
        self,
        buffer: UsageBuffer,
        redis_url: str | None = None,
        interval: float | None = None,
        spill: UsageSpill | None = None,
    ) -> None:
        self.buffer = buffer
        self.spill = spill
        self.redis_url = redis_url or settings.REDIS_URL
        self.interval = (
            settings.NEXUS_USAGE_SHIP_INTERVAL if interval is None else interval
        )
        self._client: redis.asyncio.Redis | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._shipping = periodic(
            "usage-shipper", lambda: self.interval, self._ship_once, log=logger.error
        )

    def start(self) -> None:
        """Start shipping on the running loop (the client is made here, once)."""
        if self.spill is not None:
            self.spill.open()
        self._client = redis.asyncio.Redis.from_url(
            self.redis_url,
            socket_timeout=5,
            socket_connect_timeout=5,
            retry=_NO_RETRY_ASYNC,
        )
        self._failures, self._retry_at = 0, 0.0
        self._shipping.start()

    async def stop(self) -> None:
        """Stop the task after shipping what the buffer still holds."""
        await self._shipping.stop()
        client, self._client = self._client, None
        if client is None:
            return
        try:
            while len(self.buffer):
                await self._ship(client)
        except Exception:
            logger.exception(
                "Could not ship %d usage events at shutdown", len(self.buffer)
            )
        finally:
            await client.aclose()
            keep_on_disk(self.spill, self.buffer)

    def flush_on_exit(self) -> None:
        """Ship what is left from sync code when the interpreter exits."""
        if not len(self.buffer):
            return
        client = redis.Redis.from_url(
            self.redis_url, socket_timeout=5, socket_connect_timeout=5, retry=_NO_RETRY
        )
        try:
            while len(self.buffer):
                events = self.buffer.drain(SHIP_BATCH)
                try:
                    with client.pipeline(transaction=False) as pipe:
                        _add_batch(pipe, events)
                        pipe.execute()
                except Exception:
                    self.buffer.requeue(events)
                    raise
        except Exception:
            logger.exception(
                "Could not ship %d usage events at shutdown", len(self.buffer)
            )
        finally:
            client.close()
            keep_on_disk(self.spill, self.buffer)

    async def _ship(self, client: redis.asyncio.Redis) -> None:
        events = self.buffer.drain(SHIP_BATCH)
        if not events:
            return
        try:
            async with client.pipeline(transaction=False) as pipe:
                _add_batch(pipe, events)
                await pipe.execute()
        except BaseException:
            # A failed (or cancelled) round trip may have added some of them:
            # shipping them again is safe, the event id makes the write once.
            self.buffer.requeue(events)
            raise

    async def _deliver(self, events: list[UsageItem]) -> None:
        client = self._client
        assert client is not None
        async with client.pipeline(transaction=False) as pipe:
            _add_batch(pipe, events)
            await pipe.execute()

    async def _ship_once(self) -> None:
        client = self._client
        assert client is not None
        spill = self.spill
        if not len(self.buffer) and not (spill is not None and spill.pending):
            return
        now = asyncio.get_running_loop().time()
        if self._failures and now < self._retry_at:
            # Redis is down: retry about once a second, but keep memory
            # at the spill threshold on every tick meanwhile.
            await spill_excess(spill, self.buffer)
            return
        try:
            while len(self.buffer):
                await self._ship(client)
            await replay_spilled(spill, self._deliver)
        except Exception:
            if self._failures % _LOG_EVERY == 0:
                logger.exception(
                    "Could not ship %d usage events to Redis; will retry",
                    len(self.buffer),
                )
            self._failures += 1
            self._retry_at = asyncio.get_running_loop().time() + 1.0
            await spill_excess(spill, self.buffer)
        else:
            if self._failures:
                logger.info(
                    "Shipping usage events again after %d failures", self._failures
                )
            self._failures = 0


def drain_usage_stream(
    *, batch_size: int = DRAIN_BATCH, redis_url: str | None = None
) -> int:
    """Write every event the stream holds to the database; return how many.

    How many requests' usage, that is: opens and beats go along uncounted.

    Reads `batch_size` entries (shipments) at a time, from the Redis at
    `redis_url` (default: REDIS_URL; nexus_run names its private one).

    Entries are deleted only after their rows are committed; on a database
    error they stay in the stream for the next run and the error is raised.
    """
    client = redis.Redis.from_url(
        redis_url or settings.REDIS_URL, socket_timeout=10, socket_connect_timeout=5
    )
    moved = 0
    try:
        while True:
            entries = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                client.xrange(STREAM_KEY, count=batch_size),
            )
            if not entries:
                return moved
            batch = UsageBuffer()
            for entry_id, fields in entries:
                try:
                    events = decode_events(fields[b"b"])
                except (KeyError, TypeError, ValueError):
                    logger.exception("Dropped malformed usage entry %r", entry_id)
                    continue
                for event in events:
                    batch.append(event)
                    moved += isinstance(event, UsageEvent)  # settles, not opens
            flush_usage(batch)
            client.xdel(STREAM_KEY, *[entry_id for entry_id, _ in entries])
            if len(entries) < batch_size:
                return moved
    finally:
        client.close()


def clear_usage_stream() -> None:
    """Delete every event waiting in the stream (tests, a reset installation)."""
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    try:
        client.delete(STREAM_KEY)
    finally:
        client.close()


def stream_length() -> int:
    """Return how many events wait in the stream (for reports and tests)."""
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    try:
        return cast(int, client.xlen(STREAM_KEY))
    finally:
        client.close()
