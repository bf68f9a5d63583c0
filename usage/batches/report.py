"""What operators see of batches: rates, ETAs, and the dashboard's summary."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q, Sum

from usage.models import ACTIVE_STATUSES, Batch

DASHBOARD_ROWS = 20


def lines_per_second(batch: Batch, now: datetime) -> float | None:
    """Lines finished per second since the batch started (None before)."""
    started = batch.in_progress_at
    if started is None or not batch.done:
        return None
    ended = batch.ended_at() or now
    seconds = (ended - started).total_seconds()
    return batch.done / seconds if seconds > 0 else None


def seconds_left(batch: Batch, now: datetime) -> float | None:
    """At the rate so far, seconds until every line has a result."""
    rate = lines_per_second(batch, now)
    if not batch.is_active or rate is None:
        return None
    return max(0, batch.total - batch.done) / rate


def dashboard_summary(now: datetime, all_tokens: int) -> dict[str, Any]:
    """The running batches, their lines per second, and the last day's batch
    tokens (of batches running or ended in it) beside `all_tokens`, the
    gateway's tokens of the same day."""
    running = list(Batch.objects.active().order_by("created_at")[:DASHBOARD_ROWS])
    rows = [
        {
            "batch": batch,
            "rate": lines_per_second(batch, now),
            "eta": seconds_left(batch, now),
        }
        for batch in running
    ]
    day = now - timedelta(days=1)
    recent = Batch.objects.filter(
        Q(status__in=ACTIVE_STATUSES) | Q(created_at__gte=day)
    )
    tokens = recent.aggregate(
        prompt=Sum("prompt_tokens", default=0),
        completion=Sum("completion_tokens", default=0),
    )
    batch_tokens = tokens["prompt"] + tokens["completion"]
    return {
        "rows": rows,
        "lines_per_second": sum(row["rate"] or 0.0 for row in rows),
        "tokens": batch_tokens,
        "share": batch_tokens / all_tokens if all_tokens else 0.0,
    }
