"""The staff dashboard: a live page fed by /api/usage-stream, plus its history."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any, TypedDict

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from usage.access import dashboard_viewer_required, may_see_dashboard
from usage.batches.report import dashboard_summary
from usage.models import COUNTER_FIELDS, KeySpend, UsageBucket, add_derived_fields
from usage.split_report import split_report

PROMPT_CACHE_ROWS = 20
# range name -> (how far back, width of one chart point)
HISTORY_RANGES: dict[str, tuple[timedelta, timedelta]] = {
    "hour": (timedelta(hours=1), timedelta(minutes=1)),
    "day": (timedelta(days=1), timedelta(minutes=15)),
}


class HistoryPointDict(TypedDict):
    start: str
    requests: int
    errors: int
    total_tokens: int
    cache_read_tokens: int
    latency_ms_avg: float | None


class HistoryDict(TypedDict):
    range: str
    step_seconds: int
    points: list[HistoryPointDict]
    tokens_by_model: dict[str, int]


def build_history(range_name: str, *, now: datetime | None = None) -> HistoryDict:
    """Sum the per-minute buckets of the last hour or day into chart points.

    Every step of the range has a point (zero when idle), oldest first, so a
    chart can plot them without knowing about gaps.
    """
    span, step = HISTORY_RANGES[range_name]
    now = now or timezone.now()
    step_s = int(step.total_seconds())
    end = datetime.fromtimestamp(
        (now.timestamp() // step_s + 1) * step_s, tz=now.tzinfo
    )
    start = end - span
    buckets = UsageBucket.objects.between(start, end)
    steps: dict[int, dict[str, Any]] = {}
    for row in buckets.report(["minute"]):
        index = int((row["minute"] - start).total_seconds() // step_s)
        counters = steps.setdefault(index, dict.fromkeys(COUNTER_FIELDS, 0))
        for name in COUNTER_FIELDS:
            counters[name] += row[name]
    points: list[HistoryPointDict] = []
    for index in range(int(span / step)):
        counters = add_derived_fields(
            steps.get(index, dict.fromkeys(COUNTER_FIELDS, 0))
        )
        latency = counters["latency_ms_avg"]
        points.append(
            {
                "start": (start + index * step).isoformat(),
                "requests": counters["requests"],
                "errors": counters["errors"],
                "total_tokens": counters["total_tokens"],
                "cache_read_tokens": counters["cache_read_tokens"],
                "latency_ms_avg": None if latency is None else round(latency, 1),
            }
        )
    by_model = buckets.report(["model"])
    return {
        "range": range_name,
        "step_seconds": step_s,
        "points": points,
        "tokens_by_model": {row["model"]: row["total_tokens"] for row in by_model},
    }


@require_GET
@dashboard_viewer_required
def dashboard(request: HttpRequest) -> HttpResponse:
    """The live dashboard page; its script does the rest.

    Spend per key and per team (this UTC month, from the rolled-up usage), the
    response cache's hits per model and the splits' sides compared (the last
    24 hours) are rendered with the page.
    """
    month_start = timezone.now().astimezone(UTC).date().replace(day=1)
    month = KeySpend.objects.filter(day__gte=month_start)
    spenders = month.top_spenders()
    day = UsageBucket.objects.between(timezone.now() - timedelta(days=1))
    cache_totals = day.totals()
    cache_rows = (
        day.filter(cache_hits__gt=0).report(["model"]).order_by("-cache_hits")[:20]
    )
    return render(
        request,
        "dashboard/index.html",
        {
            "batches": dashboard_summary(timezone.now(), cache_totals["total_tokens"]),
            "spenders": spenders,
            "team_spenders": month.top_teams(),
            "month": month_start,
            "prompt_cache": prompt_cache_rows(month_start),
            "cache_totals": cache_totals,
            "cache_rows": cache_rows,
            "split_sides": split_report(timezone.now() - timedelta(days=1)),
        },
    )


def prompt_cache_rows(since: date) -> list[dict[str, Any]]:
    """Per model since ``since`` (UTC): prompt tokens, how many were read from
    and written to a prompt cache, and the share read (the tokens saved).

    Only models with cached tokens; at most ``PROMPT_CACHE_ROWS``.
    """
    start = datetime(since.year, since.month, since.day, tzinfo=UTC)
    buckets = UsageBucket.objects.between(start, timezone.now() + timedelta(minutes=1))
    rows = [row for row in buckets.report(["model"]) if row["cache_read_tokens"]]
    rows.sort(key=lambda row: (-row["cache_read_tokens"], row["model"]))
    return rows[:PROMPT_CACHE_ROWS]


@require_GET
def history(request: HttpRequest) -> JsonResponse:
    """Usage history as JSON: ``?range=hour`` (default, per minute) or ``day``."""
    if not may_see_dashboard(request.user):
        return JsonResponse(
            {"detail": "Log in as staff with a role that may read usage."}, status=403
        )
    range_name = request.GET.get("range", "hour")
    if range_name not in HISTORY_RANGES:
        choices = ", ".join(HISTORY_RANGES)
        return JsonResponse(
            {"detail": f"Unknown range {range_name!r}; use one of: {choices}."},
            status=400,
        )
    return JsonResponse(build_history(range_name))
