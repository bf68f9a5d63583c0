"""Read-only usage endpoints: rolled-up totals, stats over a range, live load."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import generics, mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from nexus_lib.permissions import requires
from usage.access import DASHBOARD_PERMISSION
from usage.api.serializers import (
    ApiKeySerializer,
    ApiKeyUsageSerializer,
    ModelPriceSerializer,
    NewApiKeySerializer,
    StatsQuerySerializer,
    TeamSerializer,
    TokenQuerySerializer,
    TokenUsageRowSerializer,
    UsageStatsSerializer,
)
from usage.models import (
    SETTING_FIELDS,
    ApiKey,
    ApiKeyQuerySet,
    ModelPrice,
    Team,
    TeamQuerySet,
    UsageCountersQuerySet,
    UsageRecord,
    select_usage_rows,
)


def _usage_rows(query: dict[str, Any]) -> UsageCountersQuerySet:
    """The usage rows of the query's time range and series filters."""
    rows = select_usage_rows(query.get("since"), query.get("until"))
    return rows.for_series(
        backend=query.get("backend"), model=query.get("model"), key=query.get("key")
    )


class TokenUsageView(generics.GenericAPIView[Any]):
    """Token usage per backend × model × client key (or coarser, with ``by``).

    Without since/until: all-time totals. With them: the sum of the per-minute
    buckets in the range (kept for NEXUS_USAGE_RETENTION_DAYS). Rows are ordered
    by total tokens, largest first. Requests finish counting here after the
    next rollup (every 10 s by default). A team admin sees the usage of their
    teams' keys only.
    """

    required_permissions = requires(read=("usage.view_keyspend",))

    serializer_class = TokenUsageRowSerializer
    filter_backends = ()

    @cached_property
    def query(self) -> dict[str, Any]:
        params = TokenQuerySerializer(data=self.request.query_params)
        params.is_valid(raise_exception=True)
        return params.validated_data

    def get_queryset(self) -> QuerySet[Any, dict[str, Any]]:
        rows = _usage_rows(self.query)
        if not self.request.user.has_perm(DASHBOARD_PERMISSION):
            # A team admin: the usage of their teams' keys, nothing else.
            teams = Team.objects.visible_to(self.request.user)
            rows = rows.for_series(teams=teams)
        return rows.report(self.query["by"])

    @extend_schema(parameters=[TokenQuerySerializer])
    def get(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        assert page is not None  # pagination is configured in settings
        return self.get_paginated_response(self.get_serializer(page, many=True).data)


class UsageStatsView(APIView):
    """Requests, errors, tokens and mean latency per backend and model over a range.

    The range defaults to the last 24 hours; it is read from the per-minute
    buckets, so requests not rolled up yet (``pending_records``) are not in it.
    """

    required_permissions = requires(read=("usage.view_tokenusage",))

    @extend_schema(parameters=[StatsQuerySerializer], responses=UsageStatsSerializer)
    def get(self, request: Request) -> Response:
        query = StatsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        until = params.get("until") or timezone.now()
        rows = _usage_rows({**params, "until": until})
        stats = {
            "since": params["since"],
            "until": until,
            "totals": rows.totals(),
            "by_backend_model": rows.report(["backend", "model"]).order_by(
                "backend", "model"
            ),
            "by_model": rows.report(["model"]).order_by("model"),
            "by_backend": rows.report(["backend"]).order_by("backend"),
            "pending_records": UsageRecord.objects.pending().count(),
        }
        return Response(UsageStatsSerializer(stats).data)


class ApiKeyViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    viewsets.GenericViewSet[ApiKey],
):
    """Client API keys for the gateway (/v1): create, list, change, revoke.

    A key carries its allowed models, expiry, rate and concurrency limits,
    budgets and fair-queue settings (see docs/tenancy.md); empty (null)
    limits mean no limit. Only a hash of each secret is stored: the secret is
    in the answer to the create request and nowhere else. A revoked key is refused by every serving
    process within a second or so, and stays revoked (create a new one).
    """

    queryset = ApiKey.objects.select_related("team")
    serializer_class = ApiKeySerializer
    filterset_fields = ("name", "prefix", "is_active", "budget_period")
    ordering_fields = ("name", "created_at", "last_used_at")
    ordering = ("name", "created_at")

    def get_queryset(self) -> QuerySet[ApiKey]:
        """Every key for a global role; a team admin's teams' keys for them."""
        keys = super().get_queryset()
        assert isinstance(keys, ApiKeyQuerySet)
        return keys.visible_to(self.request.user)

    @extend_schema(responses={201: NewApiKeySerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        settings = {name: data[name] for name in SETTING_FIELDS if name in data}
        key, raw = ApiKey.objects.create_key(
            data["name"], team=data.get("team"), **settings
        )
        # The secret is in this answer and nowhere else (NewApiKeySerializer).
        data = {**self.get_serializer(key).data, "key": raw}
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=ApiKeySerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """Refuse this key from now on (idempotent)."""
        key = self.get_object()
        keys = ApiKey.objects.filter(pk=key.pk)
        assert isinstance(keys, ApiKeyQuerySet)
        keys.deactivate()
        key.refresh_from_db()
        return Response(self.get_serializer(key).data)

    @extend_schema(responses=ApiKeyUsageSerializer)
    @action(detail=True, methods=["get"])
    def usage(self, request: Request, pk: str | None = None) -> Response:
        """This key's rolled-up requests, tokens and cost: the current budget
        period (with what is left of its budgets) and all time."""
        key = self.get_object()
        return Response(ApiKeyUsageSerializer(key.spend()).data)


class ModelPriceViewSet(viewsets.ModelViewSet[ModelPrice]):
    """Model prices (USD per million tokens, in and out) for costs and budgets.

    ``model`` is a served model's name or a glob pattern (``llama3:*``): an
    exact name wins, then the longest matching pattern. Every serving process
    uses a change within a second or so; costs already recorded keep the
    price of their time.
    """

    queryset = ModelPrice.objects.all()
    serializer_class = ModelPriceSerializer
    filterset_fields = ("model",)
    ordering_fields = ("model", "updated_at")
    ordering = ("model",)


class TeamViewSet(viewsets.ModelViewSet[Team]):
    """Teams of client keys: limits and budgets (tokens and/or USD per UTC day,
    month or all time; RPM, TPM, concurrency) that all a team's keys draw on
    together, in the same admission as each key's own (docs/tenancy.md).

    A key joins a team through its ``team`` field (``/api/v1/keys``). A team
    admin sees only their own teams, read-only. A team with keys cannot be
    deleted (move or revoke its keys first).
    """

    queryset = Team.objects.prefetch_related("keys")
    serializer_class = TeamSerializer
    filterset_fields = ("name",)
    ordering_fields = ("name", "created_at")
    ordering = ("name",)

    def get_queryset(self) -> QuerySet[Team]:
        teams = super().get_queryset()
        assert isinstance(teams, TeamQuerySet)
        return teams.visible_to(self.request.user)

    def perform_destroy(self, instance: Team) -> None:
        if instance.keys.exists():
            raise ValidationError(
                {"detail": "The team has keys: move them to another team first."}
            )
        instance.delete()

    @extend_schema(responses=ApiKeyUsageSerializer)
    @action(detail=True, methods=["get"])
    def usage(self, request: Request, pk: str | None = None) -> Response:
        """The team's keys' rolled-up requests, tokens and cost: the current
        budget period (with what is left of its budgets) and all time."""
        return Response(ApiKeyUsageSerializer(self.get_object().spend()).data)
