"""Roll raw usage records up into TokenUsage and UsageBucket, exactly once.

Each batch is one transaction that adds its records to both tables and marks
them rolled up. A rollup that dies mid-way therefore leaves its batch pending,
as if it had never run, and a retried or concurrent rollup cannot add a record
twice: on PostgreSQL each batch locks its rows and skips rows another rollup
holds (``SELECT ... FOR UPDATE SKIP LOCKED``); on SQLite, transactions are
IMMEDIATE and run one at a time. The counters are raised with
``INSERT ... ON CONFLICT DO UPDATE SET n = n + excluded.n``, one statement per
table, so concurrent rollups adding to the same series never lose an update.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, cast

from django.db import connection, models, transaction
from django.db.models import Max, Q
from django.utils import timezone

from usage.models import (
    ApiKey,
    KeySpend,
    TokenUsage,
    UsageBucket,
    UsageRecord,
)

logger = logging.getLogger(__name__)

ROLLUP_BATCH_SIZE = 2000
# Rows per INSERT statement: well under SQLite's limit on bound parameters.
_ROWS_PER_STATEMENT = 500

_RECORD_COLUMNS = (
    "id",
    "backend",
    "served_model",
    "requested_model",
    "api_key_prefix",
    "created_at",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "estimated",
    "is_error",
    "latency_ms",
    "cost_nanos",
    "cache_hit",
)


class RollupConflictError(RuntimeError):
    """Some records of a batch were rolled up by someone else meanwhile."""


@dataclass(slots=True)
class _Counters:
    """Sums for one series; one attribute per usage.models.COUNTER_FIELDS."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    estimated_requests: int = 0
    estimated_tokens: int = 0
    latency_ms_sum: float = 0.0
    cost_nanos: int = 0
    cache_hits: int = 0
    cache_saved_tokens: int = 0


@dataclass(slots=True)
class _Spend:
    """One key's day in KeySpend."""

    requests: int = 0
    total_tokens: int = 0
    cost_nanos: int = 0


def roll_up_usage(*, batch_size: int = ROLLUP_BATCH_SIZE) -> int:
    """Add every pending usage record to the aggregates; return how many were added.

    Records written while it runs are left to the next rollup, so it always ends.
    Safe to run concurrently with itself and with the flusher.
    """
    last_id = UsageRecord.objects.pending().aggregate(last=Max("id"))["last"]
    if last_id is None:
        return 0
    total = 0
    while count := _roll_up_batch(last_id, batch_size):
        total += count
    return total


def _roll_up_batch(last_id: int, batch_size: int) -> int:
    with transaction.atomic():
        pending = UsageRecord.objects.pending().filter(id__lte=last_id).order_by("id")
        if connection.features.has_select_for_update_skip_locked:
            pending = pending.select_for_update(skip_locked=True)
        rows = list(pending.values_list(*_RECORD_COLUMNS)[:batch_size])
        if not rows:
            return 0
        series: dict[tuple[str, str, str], _Counters] = {}
        buckets: dict[tuple[datetime, str, str, str], _Counters] = {}
        last_used: dict[str, datetime] = {}
        spend: dict[tuple[str, date], _Spend] = {}
        for row in rows:
            (_, backend, served, requested, key, created_at, *counts) = row
            if key and (key not in last_used or created_at > last_used[key]):
                last_used[key] = created_at
            if key:
                day = spend.setdefault(
                    (key, created_at.astimezone(UTC).date()), _Spend()
                )
                day.requests += 1
                # A cache hit's tokens were saved, not spent: no budget's.
                day.total_tokens += 0 if counts[-1] else counts[2]
                day.cost_nanos += counts[-2]
            # Requests that failed before a model was chosen are filed under
            # the model the client asked for.
            name = (backend, served or requested, key)
            minute = created_at.replace(second=0, microsecond=0)
            _add(series.setdefault(name, _Counters()), *counts)
            _add(buckets.setdefault((minute, *name), _Counters()), *counts)
        now = timezone.now()
        _increment(
            TokenUsage,
            ("backend", "model", "api_key_prefix"),
            series.items(),
            replace={"updated_at": now},
        )
        _increment(
            UsageBucket,
            ("minute", "backend", "model", "api_key_prefix"),
            buckets.items(),
        )
        _increment(KeySpend, ("api_key_prefix", "day"), spend.items())
        _touch_keys(last_used)
        ids = [row[0] for row in rows]
        marked = UsageRecord.objects.filter(id__in=ids, rolled_up=False).update(
            rolled_up=True
        )
        if marked != len(ids):
            # Cannot happen while the locking above holds; rolling back is what
            # keeps the totals exact if it ever does not.
            raise RollupConflictError(
                f"{len(ids) - marked} of {len(ids)} usage records were rolled up "
                "concurrently; this batch was rolled back"
            )
    return len(rows)


def _touch_keys(last_used: dict[str, datetime]) -> None:
    """Move each client key's last use forward (a bulk update: no config bump)."""
    for prefix, used_at in last_used.items():
        ApiKey.objects.filter(prefix=prefix).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=used_at)
        ).update(last_used_at=used_at)


def _add(
    counters: _Counters,
    prompt: int,
    completion: int,
    total: int,
    cache_read: int,
    cache_write: int,
    estimated: bool,
    is_error: bool,
    latency_ms: float,
    cost_nanos: int,
    cache_hit: bool,
) -> None:
    counters.requests += 1
    counters.errors += is_error
    counters.prompt_tokens += prompt
    counters.completion_tokens += completion
    counters.total_tokens += total
    counters.cache_read_tokens += cache_read
    counters.cache_write_tokens += cache_write
    if estimated:
        counters.estimated_requests += 1
        counters.estimated_tokens += total
    counters.latency_ms_sum += latency_ms
    counters.cost_nanos += cost_nanos
    if cache_hit:
        counters.cache_hits += 1
        counters.cache_saved_tokens += total


def _increment(
    model: type[models.Model],
    key_fields: Sequence[str],
    series: Iterable[tuple[tuple[Any, ...], _Counters | _Spend]],
    *,
    replace: dict[str, Any] | None = None,
) -> None:
    """Add each series' counters to its row of `model`, creating missing rows.

    Rows are written in key order, so concurrent rollups lock shared rows in the
    same order and cannot deadlock.
    """
    replace = replace or {}
    ordered = sorted(series, key=lambda item: item[0])
    if not ordered:
        return
    counter_fields = [f.name for f in dataclasses.fields(ordered[0][1])]
    quote = connection.ops.quote_name
    table = quote(model._meta.db_table)
    columns = [*key_fields, *counter_fields, *replace]
    fields = [
        cast("models.Field[Any, Any]", model._meta.get_field(name)) for name in columns
    ]
    assignments = [
        f"{quote(name)} = {table}.{quote(name)} + excluded.{quote(name)}"
        for name in counter_fields
    ] + [f"{quote(name)} = excluded.{quote(name)}" for name in replace]
    row_sql = "(" + ", ".join(["%s"] * len(columns)) + ")"
    with connection.cursor() as cursor:
        for start in range(0, len(ordered), _ROWS_PER_STATEMENT):
            chunk = ordered[start : start + _ROWS_PER_STATEMENT]
            params: list[Any] = []
            for key, counters in chunk:
                counts = [getattr(counters, name) for name in counter_fields]
                values = (*key, *counts, *replace.values())
                params += [
                    field.get_db_prep_value(value, connection)
                    for field, value in zip(fields, values, strict=True)
                ]
            cursor.execute(
                f"INSERT INTO {table} ({', '.join(map(quote, columns))}) "
                f"VALUES {', '.join([row_sql] * len(chunk))} "
                f"ON CONFLICT ({', '.join(map(quote, key_fields))}) "
                f"DO UPDATE SET {', '.join(assignments)}",
                params,
            )
