"""Query parameters and answers of the usage endpoints."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, ClassVar

from django.db.models import QuerySet
from rest_framework import serializers

from nexus_lib.serializers import ModelCleanSerializer
from usage.models import (
    ANONYMOUS,
    MANAGE_ALL_TEAMS,
    SETTING_FIELDS,
    TEAM_LIMIT_FIELDS,
    USAGE_DIMENSIONS,
    ApiKey,
    ModelPrice,
    Team,
    nanos_to_usd,
)
from usage.periods import PERIOD_HELP, parse_moment


class UsageQuerySerializer(serializers.Serializer[Any]):
    """Which usage to read: a time range and optional series filters."""

    since = serializers.CharField(
        required=False, help_text=f"Start of the range: {PERIOD_HELP}."
    )
    until = serializers.CharField(
        required=False, help_text=f"End of the range (default: now): {PERIOD_HELP}."
    )
    backend = serializers.CharField(required=False, help_text="Backend name.")
    model = serializers.CharField(required=False, help_text="Model served.")
    key = serializers.CharField(
        required=False,
        help_text=f'Client key prefix (nx-...), or "{ANONYMOUS}" for requests made '
        "without a key.",
    )

    def validate_since(self, value: str) -> datetime:
        return _moment(value)

    def validate_until(self, value: str) -> datetime:
        return _moment(value)

    def validate_key(self, value: str) -> str:
        return "" if value == ANONYMOUS else value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        since, until = attrs.get("since"), attrs.get("until")
        if since and until and since >= until:
            raise serializers.ValidationError({"until": "Must be later than since."})
        return attrs


class TokenQuerySerializer(UsageQuerySerializer):
    by = serializers.CharField(
        required=False,
        default="backend,model,key",
        help_text="Comma-separated dimensions to group by: backend, model, key, "
        "team (default: backend,model,key).",
    )

    def validate_by(self, value: str) -> list[str]:
        names = [name.strip() for name in value.split(",") if name.strip()]
        unknown = [name for name in names if name not in USAGE_DIMENSIONS]
        if unknown or not names:
            raise serializers.ValidationError(
                f"Group by one or more of: {', '.join(USAGE_DIMENSIONS)}."
            )
        # In the canonical order, once each.
        return [name for name in USAGE_DIMENSIONS if name in names]


class StatsQuerySerializer(UsageQuerySerializer):
    since = serializers.CharField(
        required=False,
        default="24h",
        help_text=f"Start of the range (default: 24h): {PERIOD_HELP}.",
    )


def _moment(value: str) -> datetime:
    try:
        return parse_moment(value)
    except ValueError as error:
        raise serializers.ValidationError(str(error)) from None


class CountersSerializer(serializers.Serializer[Any]):
    """One row of UsageCountersQuerySet.report(), or its totals()."""

    requests = serializers.IntegerField()
    # DRF's metaclass moves declared fields off the class, so this does not
    # replace Serializer.errors at run time; only the type checker sees a clash.
    errors = serializers.IntegerField()  # type: ignore[assignment]
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    cache_read_tokens = serializers.IntegerField(
        help_text="Of prompt_tokens: read from a backend's prompt cache."
    )
    cache_write_tokens = serializers.IntegerField(
        help_text="Of prompt_tokens: written to a backend's prompt cache."
    )
    cached_share = serializers.SerializerMethodField(
        help_text="The share of prompt tokens read from a prompt cache (0 to 1)."
    )
    estimated_requests = serializers.IntegerField(
        help_text="Requests whose token counts Nexus estimated."
    )
    estimated_tokens = serializers.IntegerField(
        help_text="The part of total_tokens that is estimated."
    )
    latency_ms_avg = serializers.SerializerMethodField(
        help_text="Mean request latency in milliseconds."
    )

    def get_cached_share(self, row: dict[str, Any]) -> float:
        return round(row["cached_share"], 4)

    def get_latency_ms_avg(self, row: dict[str, Any]) -> float | None:
        average = row["latency_ms_avg"]
        return None if average is None else round(average, 1)


class TokenUsageRowSerializer(CountersSerializer):
    """Usage of one series; dimensions not grouped by are null."""

    backend = serializers.CharField(allow_null=True, default=None)
    model = serializers.CharField(allow_null=True, default=None)
    key = serializers.CharField(
        source="api_key_prefix",
        allow_null=True,
        default=None,
        help_text='Client key prefix; "" for requests made without a key.',
    )
    key_name = serializers.CharField(allow_null=True, default=None)
    team = serializers.CharField(
        source="team_name",
        allow_null=True,
        default=None,
        help_text="The key's team (grouped by team; null: keys in no team).",
    )


class StatsRowSerializer(CountersSerializer):
    backend = serializers.CharField(required=False)
    model = serializers.CharField(required=False)
    error_rate = serializers.SerializerMethodField()

    def get_error_rate(self, row: dict[str, Any]) -> float:
        return round(row["error_rate"], 4)


class UsageStatsSerializer(serializers.Serializer[Any]):
    since = serializers.DateTimeField()
    until = serializers.DateTimeField()
    totals = StatsRowSerializer()
    by_backend_model = StatsRowSerializer(many=True)
    by_model = StatsRowSerializer(many=True)
    by_backend = StatsRowSerializer(many=True)
    pending_records = serializers.IntegerField(
        help_text="Requests recorded but not rolled up yet (not in these numbers)."
    )


class LiveBackendSerializer(serializers.Serializer[Any]):
    backend = serializers.CharField()
    in_flight = serializers.IntegerField()
    max_concurrency = serializers.IntegerField(allow_null=True)
    status = serializers.CharField(allow_null=True)
    latency_ms = serializers.FloatField(
        allow_null=True, help_text="Recent time to first byte (moving average)."
    )


class LiveModelSerializer(serializers.Serializer[Any]):
    backend = serializers.CharField()
    model = serializers.CharField()
    in_flight = serializers.IntegerField()


class LiveUsageSerializer(serializers.Serializer[Any]):
    process = serializers.IntegerField(help_text="Process id of the server answering.")
    config_version = serializers.IntegerField()
    in_flight = serializers.IntegerField(help_text="Requests in flight, all backends.")
    backends = LiveBackendSerializer(many=True)
    models = LiveModelSerializer(
        many=True, help_text="Backend × model pairs with requests in flight."
    )
    buffered_events = serializers.IntegerField(
        help_text="Finished requests waiting to be written (about once a second)."
    )
    at = serializers.DateTimeField()


class TeamField(serializers.SlugRelatedField):
    """A key's team by name: one of the teams the user may manage."""

    def get_queryset(self) -> QuerySet[Team]:
        request = self.context.get("request")
        teams = Team.objects.all()
        if request is None:
            return teams
        return teams.visible_to(request.user)


class ApiKeySerializer(ModelCleanSerializer[ApiKey]):
    """A client API key. The secret is shown once, when the key is created."""

    team = TeamField(
        slug_field="name",
        required=False,
        allow_null=True,
        help_text="The team (by name) whose limits and budgets also hold this "
        "key; null: none. A team admin's keys must be in one of their teams.",
    )

    read_only_hints: ClassVar[Mapping[str, str]] = {
        "is_active": "Revoke a key with POST /api/v1/keys/{id}/revoke; a revoked "
        "key stays revoked.",
    }

    class Meta:
        model = ApiKey
        fields: tuple[str, ...] = (
            "id",
            "name",
            "prefix",
            "is_active",
            "created_at",
            "last_used_at",
            "team",
            *SETTING_FIELDS,
        )
        read_only_fields = ("prefix", "is_active", "created_at", "last_used_at")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        request = self.context.get("request")
        team = attrs.get("team", getattr(self.instance, "team", None))
        if (
            team is None
            and request is not None
            and not request.user.has_perm(f"usage.{MANAGE_ALL_TEAMS}")
        ):
            raise serializers.ValidationError(
                {"team": "Choose one of your teams: a team admin's keys are in one."}
            )
        return super().validate(attrs)


class TeamSerializer(ModelCleanSerializer[Team]):
    """A team of client keys: limits and budgets all its keys draw on together,
    on top of each key's own (null: no limit)."""

    keys = serializers.SerializerMethodField(
        help_text="The prefixes of the team's keys."
    )

    class Meta:
        model = Team
        fields = ("id", "name", "created_at", "keys", *TEAM_LIMIT_FIELDS)
        read_only_fields = ("created_at",)

    def get_keys(self, team: Team) -> list[str]:
        return [key.prefix for key in team.keys.all()]


class NewApiKeySerializer(ApiKeySerializer):
    """A key just created, with its secret: the only time it is shown."""

    key = serializers.CharField(
        read_only=True,
        help_text="The secret (nx-...) for Authorization: Bearer. Only its hash "
        "is stored: copy it now.",
    )

    class Meta(ApiKeySerializer.Meta):
        fields = (*ApiKeySerializer.Meta.fields, "key")


class SpendSerializer(serializers.Serializer[Any]):
    requests = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    cost_usd = serializers.SerializerMethodField(
        help_text="At the model prices of the time, in USD (exact: counted in "
        "nano-USD)."
    )

    def get_cost_usd(self, row: dict[str, Any]) -> str:
        return f"{nanos_to_usd(row['cost_nanos']):.9f}"


class PeriodSpendSerializer(SpendSerializer):
    period = serializers.CharField(
        help_text='The budget period that holds now: "d20261124" (UTC day), '
        '"m202611" (UTC month) or "all".'
    )
    remaining_tokens = serializers.IntegerField(
        allow_null=True, help_text="What is left of budget_tokens (null: no budget)."
    )
    remaining_usd = serializers.SerializerMethodField(
        help_text="What is left of budget_usd (null: no budget)."
    )

    def get_remaining_usd(self, row: dict[str, Any]) -> str | None:
        nanos = row["remaining_nanos"]
        return None if nanos is None else f"{nanos_to_usd(nanos):.9f}"


class ApiKeyUsageSerializer(serializers.Serializer[Any]):
    """A key's rolled-up usage and spend (requests of the last seconds are not
    in yet: the rollup runs every 10 s by default)."""

    period = PeriodSpendSerializer()
    all_time = SpendSerializer()


class ModelPriceSerializer(ModelCleanSerializer[ModelPrice]):
    """What a model costs per million tokens, in and out (USD); cached input
    and cache writes cost the input price when their prices are null."""

    class Meta:
        model = ModelPrice
        fields = (
            "id",
            "model",
            "input_per_million",
            "output_per_million",
            "cached_input_per_million",
            "cache_write_per_million",
            "cache_hit_per_million",
            "batch_price_factor",
            "updated_at",
        )
        read_only_fields = ("updated_at",)
