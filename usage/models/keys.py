"""Client API keys and token usage aggregates."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, ClassVar, Self, cast

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.query import ValuesIterable
from django.utils import timezone

from usage.limits.policy import (
    NANOS_PER_USD,
    BudgetPeriod,
    is_valid_pattern,
    period_id,
    split_patterns,
)
from usage.signals import api_keys_changed

KEY_SCHEME = "nx-"
PREFIX_LENGTH = len(KEY_SCHEME) + 8


def hash_key(raw_key: str) -> str:
    """Return the stored form of a client key (SHA-256; keys are 256-bit random)."""
    return hashlib.sha256(raw_key.encode()).hexdigest()


class ApiKeyQuerySet(models.QuerySet["ApiKey"]):
    def active(self) -> ApiKeyQuerySet:
        return self.filter(is_active=True)

    def create_key(self, name: str, **limits: Any) -> tuple[ApiKey, str]:
        """Create a key; return it with the raw secret, which is not stored.

        ``limits`` sets any of the key's limit, budget and admission fields
        (SETTING_FIELDS).
        """
        unknown = set(limits) - set(SETTING_FIELDS)
        if unknown:
            raise TypeError(f"not a limit field: {', '.join(sorted(unknown))}")
        raw = f"{KEY_SCHEME}{secrets.token_urlsafe(32)}"
        key = self.model(
            name=name, prefix=raw[:PREFIX_LENGTH], hashed_key=hash_key(raw), **limits
        )
        key.full_clean()
        key.save()
        return key, raw

    def deactivate(self) -> int:
        """Deactivate these keys everywhere; return how many were active."""
        count = self.filter(is_active=True).update(is_active=False)
        if count:
            # A bulk update sends no model signals; serving processes must still learn.
            api_keys_changed.send(sender=self.model, using=self.db)
        return count

    def for_raw_key(self, raw_key: str) -> ApiKey | None:
        """Return the active key matching a raw secret, or None."""
        key = self.active().filter(hashed_key=hash_key(raw_key)).first()
        if key is None or not key.matches(raw_key):
            return None
        return key


class Criticality(models.TextChoices):
    """How much a key's requests matter when the admission queue is full.

    The same words as ``routing.admission.Criticality`` (usage may not import
    routing).
    """

    CRITICAL = "critical", "Critical (never shed)"
    DEFAULT = "default", "Default"
    SHEDDABLE = "sheddable", "Sheddable (shed first)"


class ApiKey(models.Model):
    """A client credential for the gateway; only a hash of the secret is stored."""

    name = models.CharField(max_length=100)
    prefix = models.CharField(
        max_length=PREFIX_LENGTH,
        unique=True,
        editable=False,
        help_text="The first characters of the key, to recognise it by.",
    )
    hashed_key = models.CharField(max_length=64, unique=True, editable=False)
    is_active = models.BooleanField("active", default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    admission_weight = models.FloatField(
        "fair-queue weight",
        default=1.0,
        validators=[MinValueValidator(0.001), MaxValueValidator(1000)],
        help_text="This key's share of busy backends against other keys' (1 is "
        "equal; 3 gets three times the share of a key weighing 1).",
    )
    max_criticality = models.CharField(
        "highest criticality",
        max_length=16,
        choices=Criticality.choices,
        default=Criticality.DEFAULT,
        help_text="The most a request may claim with X-Nexus-Criticality; "
        "requests without the header get this level, capped at default.",
    )
    allowed_models = models.CharField(
        max_length=2000,
        blank=True,
        default="",
        help_text="Comma-separated model names, aliases or glob patterns "
        "(llama3:*) this key may use; empty allows every model.",
    )
    expires_at = models.DateTimeField(
        "expires", null=True, blank=True, help_text="After this the key gets 401."
    )
    max_concurrency = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Requests in flight at once, gateway-wide; empty: no limit.",
    )
    rpm_limit = models.PositiveIntegerField(
        "requests per minute",
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Empty: no limit.",
    )
    tpm_limit = models.PositiveIntegerField(
        "tokens per minute",
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Prompt and completion tokens; empty: no limit.",
    )
    budget_period = models.CharField(
        max_length=8,
        choices=BudgetPeriod.choices(),
        default=BudgetPeriod.MONTH,
        help_text="What the budgets cover: the current UTC day, month, or all time.",
    )
    budget_tokens = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Tokens this key may use per budget period; empty: no limit.",
    )
    budget_usd = models.DecimalField(
        "budget (USD)",
        max_digits=14,
        decimal_places=4,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0.0001"))],
        help_text="Spend (at the model prices) per budget period; empty: no limit.",
    )

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ("name", "created_at")
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    def clean(self) -> None:
        bad = [p for p in self.model_patterns if not is_valid_pattern(p)]
        if bad:
            raise ValidationError(
                {
                    "allowed_models": "Not a model name or glob pattern: "
                    + ", ".join(repr(p[:60]) for p in bad)
                }
            )
        self.allowed_models = ",".join(self.model_patterns)

    def matches(self, raw_key: str) -> bool:
        return hmac.compare_digest(self.hashed_key, hash_key(raw_key))

    @property
    def model_patterns(self) -> tuple[str, ...]:
        """The allow-list as a tuple (empty: every model)."""
        return split_patterns(self.allowed_models)

    @property
    def budget_nanos(self) -> int | None:
        """The money budget in nano-USD (the unit costs are counted in)."""
        if self.budget_usd is None:
            return None
        return int(self.budget_usd * NANOS_PER_USD)

    def is_expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (
            now or timezone.now()
        )

    def spend(self, now: datetime | None = None) -> dict[str, Any]:
        """Rolled-up requests, tokens and cost (nano-USD) of the current budget
        period and of all time, with what is left of the budgets."""
        moment = now or timezone.now()
        rows = KeySpend.objects.filter(api_key_prefix=self.prefix)
        totals = rows.totals()
        period: dict[str, Any] = {
            **rows.for_period(self.budget_period, moment).totals()
        }
        period["period"] = period_id(self.budget_period, moment.timestamp())
        budget_nanos = self.budget_nanos
        period["remaining_tokens"] = (
            None
            if self.budget_tokens is None
            else max(self.budget_tokens - period["total_tokens"], 0)
        )
        period["remaining_nanos"] = (
            None
            if budget_nanos is None
            else max(budget_nanos - period["cost_nanos"], 0)
        )
        return {"period": period, "all_time": totals}


# The fields that limit what a key may do (create_key(), the API, the commands).
LIMIT_FIELDS = (
    "allowed_models",
    "expires_at",
    "max_concurrency",
    "rpm_limit",
    "tpm_limit",
    "budget_period",
    "budget_tokens",
    "budget_usd",
)
# Everything an operator sets on a key besides its name (the API's fields too).
SETTING_FIELDS = (*LIMIT_FIELDS, "admission_weight", "max_criticality")


class ModelPrice(models.Model):
    """What a model costs per million tokens, in and out (USD).

    ``model`` is a served model's name or a glob pattern (``llama3:*``); an
    exact name wins over patterns, and the longest matching pattern over
    shorter ones. A local model may have a price too, to charge teams for GPU
    time. Costs are counted in nano-USD, so prices have at most 3 decimals.
    """

    model = models.CharField(
        max_length=200, unique=True, help_text="Model name or glob pattern."
    )
    input_per_million = models.DecimalField(
        "input (USD per 1M tokens)",
        max_digits=12,
        decimal_places=3,
        default=Decimal(0),
        validators=[MinValueValidator(Decimal(0))],
    )
    output_per_million = models.DecimalField(
        "output (USD per 1M tokens)",
        max_digits=12,
        decimal_places=3,
        default=Decimal(0),
        validators=[MinValueValidator(Decimal(0))],
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("model",)
        verbose_name = "model price"

    def __str__(self) -> str:
        return (
            f"{self.model}: ${self.input_per_million} in / "
            f"${self.output_per_million} out per 1M tokens"
        )

    def clean(self) -> None:
        if not is_valid_pattern(self.model):
            raise ValidationError({"model": "Not a model name or glob pattern."})

    @property
    def input_nanos(self) -> int:
        """Nano-USD per input token ($X per 1M tokens is X*1000 nano-USD each)."""
        return int(self.input_per_million * 1000)

    @property
    def output_nanos(self) -> int:
        return int(self.output_per_million * 1000)


# Stands for "no key" (client auth off) where a key is named in text (the API's
# and the admin's key filters); real prefixes start with "nx-".
ANONYMOUS = "-"


def describe_key(prefix: str, name: str | None) -> str:
    """Return how reports label a client key: by name and prefix.

    ``name`` is None when no key has the prefix any more (deleted).
    """
    if not prefix:
        return "anonymous"
    if name is None:
        return f"{prefix}… (deleted)"
    return f"{name} ({prefix}…)"


# What usage can be grouped by, and the column each dimension reads.
USAGE_DIMENSIONS = {"backend": "backend", "model": "model", "key": "api_key_prefix"}
COUNTER_FIELDS = (
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "estimated_requests",
    "estimated_tokens",
    "latency_ms_sum",
    "cost_nanos",
)


def add_derived_fields(counters: dict[str, Any]) -> dict[str, Any]:
    """Add the figures every usage report derives from summed counters; return it.

    ``latency_ms_avg`` (None without requests), ``error_rate`` (errors per
    request) and ``estimated_share`` (the share of tokens Nexus estimated);
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
    counters["cost_usd"] = nanos_to_usd(counters["cost_nanos"])
    return counters


def nanos_to_usd(nanos: int | None) -> Decimal:
    """Nano-USD as USD (a Decimal with 9 places, exact)."""
    return Decimal(nanos or 0).scaleb(-9)


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
    ) -> Self:
        """Keep the rows of one backend, model and/or client key prefix."""
        rows = self
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
        rows = self.order_by().values(*columns).annotate(**sums)
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


class Endpoint(models.TextChoices):
    CHAT = "chat", "Chat completions"
    COMPLETIONS = "completions", "Completions"
    EMBEDDINGS = "embeddings", "Embeddings"
    MESSAGES = "messages", "Anthropic messages"
    RESPONSES = "responses", "OpenAI responses"
    OLLAMA_CHAT = "ollama-chat", "Ollama chat"
    OLLAMA_GENERATE = "ollama-generate", "Ollama generate"
    OLLAMA_EMBED = "ollama-embed", "Ollama embeddings"


class UsageRecordQuerySet(models.QuerySet["UsageRecord"]):
    def pending(self) -> UsageRecordQuerySet:
        """Records not yet added to the aggregates."""
        return self.filter(rolled_up=False)

    def prune(self, retention_hours: float) -> int:
        """Delete rolled-up records older than the retention; return how many."""
        cutoff = timezone.now() - timedelta(hours=retention_hours)
        deleted, _ = self.filter(rolled_up=True, created_at__lt=cutoff).delete()
        return deleted


class UsageRecord(models.Model):
    """One gateway request's usage, as the proxy recorded it, before rollup.

    Written only by ``usage.flush``; the rollup adds each row to TokenUsage and
    UsageBucket and sets ``rolled_up`` in the same transaction. Rolled-up rows
    are kept for a while (NEXUS_USAGE_RECORD_RETENTION_HOURS): a flush retried
    after an ambiguous failure then still finds its rows by ``event_id`` and
    does not write them twice.
    """

    event_id = models.CharField(
        max_length=32, unique=True, help_text="Nexus's unique id for the event."
    )
    request_id = models.CharField(
        max_length=128, help_text="The X-Request-Id of the request (may repeat)."
    )
    endpoint = models.CharField(max_length=16, choices=Endpoint.choices)
    api_key_prefix = models.CharField(
        "API key", max_length=PREFIX_LENGTH, blank=True, default=""
    )
    backend = models.CharField(max_length=100, blank=True, default="")
    requested_model = models.CharField(max_length=200, blank=True, default="")
    served_model = models.CharField(max_length=200, blank=True, default="")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    total_tokens = models.PositiveBigIntegerField(default=0)
    estimated = models.BooleanField(
        default=False, help_text="Token counts are Nexus's estimate."
    )
    latency_ms = models.FloatField("latency (ms)", default=0.0)
    cost_nanos = models.PositiveBigIntegerField("cost (nano-USD)", default=0)
    status = models.PositiveSmallIntegerField(help_text="HTTP status sent.")
    streamed = models.BooleanField(default=False)
    error = models.CharField(max_length=100, blank=True, default="")
    is_error = models.BooleanField(
        "failed", default=False, help_text="Counted in errors (UsageEvent.is_error)."
    )
    created_at = models.DateTimeField(db_index=True)
    rolled_up = models.BooleanField(default=False)

    objects = UsageRecordQuerySet.as_manager()

    class Meta:
        ordering = ("-created_at",)
        verbose_name = "usage record"
        indexes = (
            # The rollup's work queue: small, because rolled-up rows leave it.
            models.Index(
                fields=("id",), condition=Q(rolled_up=False), name="usagerecord_pending"
            ),
        )

    def __str__(self) -> str:
        return f"{self.request_id} {self.backend} / {self.served_model}"


class KeySpendQuerySet(models.QuerySet["KeySpend"]):
    def for_period(self, period: str, now: datetime | None = None) -> KeySpendQuerySet:
        """Keep the days of the budget period (day, month, total) that holds now."""
        today = (now or timezone.now()).astimezone(UTC).date()
        if period == BudgetPeriod.DAY:
            return self.filter(day=today)
        if period == BudgetPeriod.MONTH:
            return self.filter(day__gte=today.replace(day=1))
        return self

    def totals(self) -> dict[str, int]:
        """Requests, total tokens and cost (nano-USD) summed over these rows."""
        sums = self.aggregate(
            requests=Sum("requests"),
            total_tokens=Sum("total_tokens"),
            cost_nanos=Sum("cost_nanos"),
        )
        return {name: value or 0 for name, value in sums.items()}

    def top_spenders(self, limit: int = 20) -> list[dict[str, Any]]:
        """Requests, tokens and cost per key over these rows, most cost first,
        with each key's name and budgets (prefix "" is requests without a key)."""
        rows = list(
            self.order_by()
            .values("api_key_prefix")
            .annotate(
                requests=Sum("requests"),
                total_tokens=Sum("total_tokens"),
                cost_nanos=Sum("cost_nanos"),
            )
            .order_by("-cost_nanos", "-total_tokens", "api_key_prefix")[:limit]
        )
        keys = ApiKey.objects.in_bulk(
            [row["api_key_prefix"] for row in rows], field_name="prefix"
        )
        for row in rows:
            key = keys.get(row["api_key_prefix"])
            row["key"] = key
            row["cost_usd"] = nanos_to_usd(row["cost_nanos"])
        return rows

    def spend_by_key(self) -> dict[str, tuple[int, int]]:
        """Return (tokens, cost in nano-USD) per key prefix."""
        rows = (
            self.order_by()
            .values("api_key_prefix")
            .annotate(tokens=Sum("total_tokens"), nanos=Sum("cost_nanos"))
        )
        return {
            row["api_key_prefix"]: (row["tokens"] or 0, row["nanos"] or 0)
            for row in rows
        }


class KeySpend(models.Model):
    """Tokens and cost per client key per UTC day: what budgets are checked against.

    Written by the rollup in the same transaction as the other aggregates (so
    exactly once) and never pruned: a row per key per day is small, and it
    holds the day, month and all-time totals the fast counters are reconciled
    from.
    """

    api_key_prefix = models.CharField("API key", max_length=PREFIX_LENGTH)
    day = models.DateField()
    requests = models.PositiveBigIntegerField(default=0)
    total_tokens = models.PositiveBigIntegerField(default=0)
    cost_nanos = models.PositiveBigIntegerField("cost (nano-USD)", default=0)

    objects = KeySpendQuerySet.as_manager()

    class Meta:
        ordering = ("-day", "api_key_prefix")
        verbose_name = "key spend"
        verbose_name_plural = "key spend"
        constraints = (
            models.UniqueConstraint(
                fields=("api_key_prefix", "day"), name="keyspend_unique_day"
            ),
        )

    def __str__(self) -> str:
        return f"{self.day} {self.api_key_prefix}"
