"""Read-only usage endpoints: rolled-up totals, stats over a range, live load."""

from __future__ import annotations

from collections import defaultdict
from functools import cached_property
from typing import Any, cast

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from usage.api.serializers import (
    StatsQuerySerializer,
    TokenQuerySerializer,
    TokenUsageRowSerializer,
    UsageStatsSerializer,
)
from usage.models import (
    COUNTER_FIELDS,
    USAGE_DIMENSIONS,
    ApiKey,
    TokenUsage,
    UsageBucket,
    UsageCountersQuerySet,
    UsageRecord,
)


def _usage_rows(query: dict[str, Any]) -> UsageCountersQuerySet:
    """All-time totals, or the per-minute buckets of a time range, filtered."""
    rows: UsageCountersQuerySet
    if "since" in query or "until" in query:
        rows = UsageBucket.objects.between(query.get("since"), query.get("until"))
    else:
        rows = cast(UsageCountersQuerySet, TokenUsage.objects.all())
    return rows.for_series(
        backend=query.get("backend"), model=query.get("model"), key=query.get("key")
    )


class TokenUsageView(generics.GenericAPIView[Any]):
    """Token usage per backend × model × client key (or coarser, with ``by``).

    Without since/until: all-time totals. With them: the sum of the per-minute
    buckets in the range (kept for NEXUS_USAGE_RETENTION_DAYS). Rows are ordered
    by total tokens, largest first. Requests finish counting here after the
    next rollup (every 10 s by default).
    """

    serializer_class = TokenUsageRowSerializer
    permission_classes = (IsAdminUser,)
    filter_backends = ()

    @cached_property
    def query(self) -> dict[str, Any]:
        params = TokenQuerySerializer(data=self.request.query_params)
        params.is_valid(raise_exception=True)
        return params.validated_data

    def get_queryset(self) -> QuerySet[Any, dict[str, Any]]:
        by = self.query["by"]
        columns = [USAGE_DIMENSIONS[name] for name in by]
        return _usage_rows(self.query).summarize(by).order_by("-total_tokens", *columns)

    @extend_schema(parameters=[TokenQuerySerializer])
    def get(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        assert page is not None  # pagination is configured in settings
        if "key" in self.query["by"]:
            prefixes = {row["api_key_prefix"] for row in page}
            names = dict(
                ApiKey.objects.filter(prefix__in=prefixes).values_list("prefix", "name")
            )
            for row in page:
                row["key_name"] = names.get(row["api_key_prefix"])
        return self.get_paginated_response(self.get_serializer(page, many=True).data)


class UsageStatsView(APIView):
    """Requests, errors, tokens and mean latency per backend and model over a range.

    The range defaults to the last 24 hours; it is read from the per-minute
    buckets, so requests not rolled up yet (``pending_records``) are not in it.
    """

    permission_classes = (IsAdminUser,)

    @extend_schema(parameters=[StatsQuerySerializer], responses=UsageStatsSerializer)
    def get(self, request: Request) -> Response:
        query = StatsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        until = params.get("until") or timezone.now()
        pairs = list(
            _usage_rows({**params, "until": until}).summarize(["backend", "model"])
        )
        by_model: dict[str, dict[str, Any]] = defaultdict(_zero)
        by_backend: dict[str, dict[str, Any]] = defaultdict(_zero)
        totals = _zero()
        for row in pairs:
            for bucket in (by_model[row["model"]], by_backend[row["backend"]], totals):
                for name in COUNTER_FIELDS:
                    bucket[name] += row[name]
        stats = {
            "since": params["since"],
            "until": until,
            "totals": totals,
            "by_backend_model": pairs,
            "by_model": [{"model": k, **v} for k, v in sorted(by_model.items())],
            "by_backend": [{"backend": k, **v} for k, v in sorted(by_backend.items())],
            "pending_records": UsageRecord.objects.pending().count(),
        }
        return Response(UsageStatsSerializer(stats).data)


def _zero() -> dict[str, Any]:
    return dict.fromkeys(COUNTER_FIELDS, 0)
