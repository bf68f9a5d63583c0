"""The staff dashboard: a live page fed by /api/usage-stream, plus its history."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TypedDict

from django.contrib.admin.views.decorators import staff_member_required
from django.db.models import Sum
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from usage.models import UsageBucket

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
    sums: dict[int, list[float]] = {}
    rows = (
        UsageBucket.objects.between(start, end)
        .order_by()
        .values("minute")
        .annotate(
            requests=Sum("requests"),
            errors=Sum("errors"),
            tokens=Sum("total_tokens"),
            latency=Sum("latency_ms_sum"),
        )
    )
    for row in rows:
        index = int((row["minute"] - start).total_seconds() // step_s)
        point = sums.setdefault(index, [0, 0, 0, 0.0])
        point[0] += row["requests"]
        point[1] += row["errors"]
        point[2] += row["tokens"]
        point[3] += row["latency"]
    points: list[HistoryPointDict] = []
    for index in range(int(span / step)):
        requests, errors, tokens, latency = sums.get(index, [0, 0, 0, 0.0])
        points.append(
            {
                "start": (start + index * step).isoformat(),
                "requests": int(requests),
                "errors": int(errors),
                "total_tokens": int(tokens),
                "latency_ms_avg": round(latency / requests, 1) if requests else None,
            }
        )
    by_model = (
        UsageBucket.objects.between(start, end)
        .order_by()
        .values("model")
        .annotate(tokens=Sum("total_tokens"))
        .order_by("-tokens", "model")
    )
    return {
        "range": range_name,
        "step_seconds": step_s,
        "points": points,
        "tokens_by_model": {row["model"]: row["tokens"] for row in by_model},
    }


@require_GET
@staff_member_required
def dashboard(request: HttpRequest) -> HttpResponse:
    """The live dashboard page; its script does the rest."""
    return render(request, "dashboard/index.html")


@require_GET
def history(request: HttpRequest) -> JsonResponse:
    """Usage history as JSON: ``?range=hour`` (default, per minute) or ``day``."""
    user = request.user
    if not (user.is_active and user.is_staff):
        return JsonResponse({"detail": "Log in as staff to read usage."}, status=403)
    range_name = request.GET.get("range", "hour")
    if range_name not in HISTORY_RANGES:
        choices = ", ".join(HISTORY_RANGES)
        return JsonResponse(
            {"detail": f"Unknown range {range_name!r}; use one of: {choices}."},
            status=400,
        )
    return JsonResponse(build_history(range_name))
