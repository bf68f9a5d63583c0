"""Compare the sides of weighted splits: requests, errors, latency, tokens, cost.

Read from usage records (each carries its split and side), so it covers the
records' retention (NEXUS_USAGE_RECORD_RETENTION_HOURS, 48 h by default);
``nexus_usage --by split`` and the split's admin page show it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.db.models import Count, Q, Sum

from usage.models import UsageRecord

NANOS_PER_USD = 1_000_000_000


@dataclass(frozen=True, slots=True)
class SideUsage:
    """One side of one split over the period."""

    split: str
    side: str
    requests: int
    errors: int
    p50_ms: float
    p95_ms: float
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_report(since: datetime | None, split: str | None = None) -> list[SideUsage]:
    """Every split side's usage since `since` (all kept records if None)."""
    records = UsageRecord.objects.exclude(split="")
    if since is not None:
        records = records.filter(created_at__gte=since)
    if split is not None:
        records = records.filter(split=split)
    grouped = (
        records.values("split", "split_side")
        .annotate(
            requests=Count("id"),
            errors=Count("id", filter=Q(is_error=True)),
            prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
            cost=Sum("cost_nanos"),
        )
        .order_by("split", "split_side")
    )
    sides = []
    for row in grouped:
        latencies = records.filter(split=row["split"], split_side=row["split_side"])
        sides.append(
            SideUsage(
                split=row["split"],
                side=row["split_side"],
                requests=row["requests"],
                errors=row["errors"],
                p50_ms=_percentile(latencies, row["requests"], 0.50),
                p95_ms=_percentile(latencies, row["requests"], 0.95),
                prompt_tokens=row["prompt"] or 0,
                completion_tokens=row["completion"] or 0,
                cost_usd=(row["cost"] or 0) / NANOS_PER_USD,
            )
        )
    return sides


def _percentile(records: Any, count: int, share: float) -> float:
    """The latency at `share` of the side's records, by the database's sort."""
    if not count:
        return 0.0
    index = max(math.ceil(count * share) - 1, 0)  # nearest rank
    value = records.order_by("latency_ms").values_list("latency_ms", flat=True)[index]
    return round(float(value), 1)
