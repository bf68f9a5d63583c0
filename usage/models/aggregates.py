"""The usage aggregates: all-time totals and per-minute buckets, and reports on them.

The rollup adds each usage record to ``TokenUsage`` (all time, per backend,
model and client key) and ``UsageBucket`` (the same per minute, for history
charts, pruned after NEXUS_USAGE_RETENTION_DAYS). Both share the counters of
``UsageCounters`` and the ``report()`` and ``totals()`` of its queryset, which
every usage surface reads.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, ClassVar, Self, cast

from django.db import models
from django.db.models import OuterRef, QuerySet, Subquery, Sum
from django.db.models.query import ValuesIterable
from django.utils import timezone

from usage.models.keys import PREFIX_LENGTH, ApiKey
from usage.models.prices import nanos_to_usd

# What usage can be grouped by, and the column each dimension reads.
USAGE_DIMENSIONS = {
    "backend": "backend",
    "model": "model",
    "key": "api_key_prefix",
    # The team of the key now (requests of keys in no team: None).
    "team": "team_name",
}
COUNTER_FIELDS = (
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "estimated_requests",
    "estimated_tokens",
    "latency_ms_sum",
    "cost_nanos",
    "cache_hits",
    "cache_saved_tokens",
)


def add_derived_fields(counters: dict[str, Any]) -> dict[str, Any]:
    """Add the figures every usage report derives from summed counters; return it.

    ``latency_ms_avg`` (None without requests), ``error_rate`` (errors per
    request), ``estimated_share`` (the share of tokens Nexus estimated) and
    ``cached_share`` (the share of prompt tokens read from a prompt cache);
    unrounded, so each surface rounds for its readers.
    """
    requests, tokens = counters["requests"], counters["total_tokens"]
    counters["latency_ms_avg"] = (
        counters["latency_ms_sum"] / requests if requests else None
    )
    counters["error_rate"] = counters["errors"] / requests if requests else 0.0
    counters["estimated_share"] = (
        counters["estimated_tokens"] / tokens if tokens else 0.0
    )
    prompt = counters["prompt_tokens"]
    counters["cached_share"] = counters["cache_read_tokens"] / prompt if prompt else 0.0
    counters["cost_usd"] = nanos_to_usd(counters["cost_nanos"])
    counters["cache_hit_rate"] = counters["cache_hits"] / requests if requests else 0.0
    return counters


class _ReportRows(ValuesIterable):
    """Rows of a values() query with add_derived_fields() applied to each."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for row in super().__iter__():
            yield add_derived_fields(row)


class UsageCountersQuerySet(models.QuerySet[Any]):
    # The dimensions report() accepts; a subclass may add its own.
    dimensions: ClassVar[Mapping[str, str]] = USAGE_DIMENSIONS

    def for_series(
        self,
        *,
        backend: str | None = None,
        model: str | None = None,
        key: str | None = None,
        teams: QuerySet[Any] | None = None,
    ) -> Self:
        """Keep the rows of one backend, model and/or client key prefix, and of
        the keys of `teams` (a Team queryset) when given."""
        rows = self
        if teams is not None:
            members = ApiKey.objects.filter(team__in=teams).values("prefix")
            rows = rows.filter(api_key_prefix__in=members)
        if backend is not None:
            rows = rows.filter(backend=backend)
        if model is not None:
            rows = rows.filter(model=model)
        if key is not None:
            rows = rows.filter(api_key_prefix=key)
        return rows

    def report(self, by: Sequence[str]) -> QuerySet[Any, dict[str, Any]]:
        """Sum the counters per value of the ``by`` dimensions: the usage report.

        Each row is a dict with the dimension columns, one sum per counter, the
        fields add_derived_fields() derives, and, when grouped by key,
        ``key_name`` (None for no key or a deleted one). Rows come largest total
        first, then in dimension order; still a query, so it pages in SQL.
        """
        columns = [self.dimensions[name] for name in by]
        sums = {name: Sum(name) for name in COUNTER_FIELDS}
        rows = self.order_by()
        if "team_name" in columns:
            keys = ApiKey.objects.filter(prefix=OuterRef("api_key_prefix"))
            rows = rows.annotate(team_name=Subquery(keys.values("team__name")[:1]))
        rows = rows.values(*columns).annotate(**sums)
        if "api_key_prefix" in columns:
            keys = ApiKey.objects.filter(prefix=OuterRef("api_key_prefix"))
            rows = rows.annotate(key_name=Subquery(keys.values("name")[:1]))
        rows = rows.order_by("-total_tokens", *columns)
        # values() sets its row type when called, so the derived fields are
        # added the way values() builds its dicts: by the query's iterable.
        rows._iterable_class = _ReportRows
        return rows

    def totals(self) -> dict[str, Any]:
        """Sum the counters of all these rows (zeros when there are none).

        Returns one dict shaped like a report() row without dimensions.
        """
        sums = {name: Sum(name, default=0) for name in COUNTER_FIELDS}
        return add_derived_fields(self.order_by().aggregate(**sums))


class UsageCounters(models.Model):
    """Counters shared by the aggregate and per-minute usage tables."""

    backend = models.CharField(max_length=100, help_text="Backend name.")
    model = models.CharField(max_length=200, help_text="Model actually served.")
    api_key_prefix = models.CharField(
        "API key",
        max_length=PREFIX_LENGTH,
        blank=True,
        default="",
        help_text="Prefix of the client key; blank when auth is off.",
    )
    requests = models.PositiveBigIntegerField(default=0)
    errors = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    total_tokens = models.PositiveBigIntegerField(default=0)
    cache_read_tokens = models.PositiveBigIntegerField(
        "cached input tokens",
        default=0,
        help_text="Of the prompt tokens: read from a backend's prompt cache.",
    )
    cache_write_tokens = models.PositiveBigIntegerField(
        "cache write tokens",
        default=0,
        help_text="Of the prompt tokens: written to a backend's prompt cache.",
    )
    estimated_requests = models.PositiveBigIntegerField(
        default=0,
        help_text="Requests whose token counts Nexus estimated (the backend "
        "reported none).",
    )
    estimated_tokens = models.PositiveBigIntegerField(
        default=0, help_text="The part of total tokens that is estimated."
    )
    latency_ms_sum = models.FloatField(
        "latency sum (ms)",
        default=0.0,
        help_text="Sum of request latencies; divide by requests for the mean.",
    )
    cost_nanos = models.PositiveBigIntegerField(
        "cost (nano-USD)", default=0, help_text="At the model prices of the time."
    )
    cache_hits = models.PositiveBigIntegerField(
        default=0, help_text="Requests answered from the response cache."
    )
    cache_saved_tokens = models.PositiveBigIntegerField(
        default=0,
        help_text="Tokens of the cached answers served (not computed again); "
        "also in total tokens.",
    )

    class Meta:
        abstract = True

    @property
    def cost_usd(self) -> Decimal:
        return nanos_to_usd(self.cost_nanos)

    @property
    def latency_ms_avg(self) -> float | None:
        return self.latency_ms_sum / self.requests if self.requests else None


class TokenUsage(UsageCounters):
    """All-time usage per backend × model × client key."""

    updated_at = models.DateTimeField(auto_now=True)

    objects = UsageCountersQuerySet.as_manager()

    class Meta:
        ordering = ("backend", "model", "api_key_prefix")
        verbose_name = "token usage"
        verbose_name_plural = "token usage"
        constraints = (
            models.UniqueConstraint(
                fields=("backend", "model", "api_key_prefix"),
                name="tokenusage_unique_series",
            ),
        )

    def __str__(self) -> str:
        return f"{self.backend} / {self.model} / {self.api_key_prefix or 'anonymous'}"


class UsageBucketQuerySet(UsageCountersQuerySet):
    # The history charts report per minute.
    dimensions: ClassVar[Mapping[str, str]] = {**USAGE_DIMENSIONS, "minute": "minute"}

    def between(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> UsageBucketQuerySet:
        """Keep the minutes that start at or after `since` and before `until`."""
        rows = self
        if since is not None:
            rows = rows.filter(minute__gte=since.replace(second=0, microsecond=0))
        if until is not None:
            rows = rows.filter(minute__lt=until)
        return rows

    def older_than(self, cutoff: datetime) -> UsageBucketQuerySet:
        return self.filter(minute__lt=cutoff)

    def prune(self, retention_days: int) -> int:
        """Delete buckets older than the retention period; return how many."""
        cutoff = timezone.now() - timedelta(days=retention_days)
        deleted, _ = self.older_than(cutoff).delete()
        return deleted


class UsageBucket(UsageCounters):
    """Usage per minute per backend × model × client key, for history charts."""

    minute = models.DateTimeField(db_index=True, help_text="Start of the minute (UTC).")

    objects = UsageBucketQuerySet.as_manager()

    class Meta:
        ordering = ("-minute", "backend", "model")
        verbose_name = "usage bucket"
        constraints = (
            models.UniqueConstraint(
                fields=("minute", "backend", "model", "api_key_prefix"),
                name="usagebucket_unique_series",
            ),
        )

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.backend} / {self.model}"


def select_usage_rows(
    since: datetime | None = None, until: datetime | None = None
) -> UsageCountersQuerySet:
    """Return the usage rows a report over a time range reads.

    Without a range: the all-time totals (TokenUsage). With one: the per-minute
    buckets in it, kept for NEXUS_USAGE_RETENTION_DAYS.
    """
    if since is None and until is None:
        return cast(UsageCountersQuerySet, TokenUsage.objects.all())
    return UsageBucket.objects.between(since, until)
