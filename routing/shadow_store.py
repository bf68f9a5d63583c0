"""Keep shadow comparisons: the newest N per shadow, each answer size-capped.

The gateway hands its comparisons here in batches, off the request path
(``gateway/shadows.py``, through ``database_sync_to_async``); every serving
process writes to the same table, so the admin shows them all, in both modes.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import transaction

from routing.core.shadow_compare import ComparisonRow
from routing.models import Shadow, ShadowComparison


def save_comparisons(rows: list[ComparisonRow]) -> int:
    """Store the rows of shadows that still exist, then trim each shadow to
    its newest ``keep``; return how many were stored."""
    shadows = {
        shadow.model: shadow
        for shadow in Shadow.objects.filter(model__in={row.model for row in rows})
    }
    kept = [
        _comparison(shadows[row.model], row) for row in rows if row.model in shadows
    ]
    with transaction.atomic():
        ShadowComparison.objects.bulk_create(kept)
        for shadow in {comparison.shadow for comparison in kept}:
            _trim(shadow)
    return len(kept)


def _trim(shadow: Shadow) -> None:
    newest = shadow.comparisons.order_by("-created_at", "-id").values_list(
        "id", flat=True
    )[: shadow.keep]
    shadow.comparisons.exclude(id__in=list(newest)).delete()


def _comparison(shadow: Shadow, row: ComparisonRow) -> ShadowComparison:
    cap = shadow.max_answer_chars
    return ShadowComparison(
        shadow=shadow,
        request_id=row.request_id[:128],
        created_at=datetime.fromtimestamp(row.created_at, tz=UTC),
        prompt=_clean(row.prompt[:cap]),
        primary_model=row.primary_model[:200],
        primary_answer=_clean(row.primary_answer[:cap]),
        primary_latency_ms=row.primary_latency_ms,
        primary_tokens=min(row.primary_tokens, 2**31 - 1),
        primary_finish=row.primary_finish[:32],
        shadow_answer=_clean(row.shadow_answer[:cap]),
        shadow_latency_ms=row.shadow_latency_ms,
        shadow_tokens=min(row.shadow_tokens, 2**31 - 1),
        shadow_finish=row.shadow_finish[:32],
        shadow_error=row.shadow_error[:200],
        similarity=row.similarity,
        tools_match=row.tools_match,
        json_valid=row.json_valid,
    )


def _clean(text: str) -> str:
    # PostgreSQL text holds no NUL, and UTF-8 no lone surrogate.
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode()
