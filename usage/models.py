"""Client API keys and token usage aggregates."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, Self

from django.db import models
from django.db.models import Q, QuerySet, Sum
from django.utils import timezone

from usage.signals import api_keys_changed

KEY_SCHEME = "nx-"
PREFIX_LENGTH = len(KEY_SCHEME) + 8


def hash_key(raw_key: str) -> str:
    """Return the stored form of a client key (SHA-256; keys are 256-bit random)."""
    return hashlib.sha256(raw_key.encode()).hexdigest()


class ApiKeyQuerySet(models.QuerySet["ApiKey"]):
    def active(self) -> ApiKeyQuerySet:
        return self.filter(is_active=True)

    def create_key(self, name: str) -> tuple[ApiKey, str]:
        """Create a key; return it with the raw secret, which is not stored."""
        raw = f"{KEY_SCHEME}{secrets.token_urlsafe(32)}"
        key = self.model(
            name=name, prefix=raw[:PREFIX_LENGTH], hashed_key=hash_key(raw)
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

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ("name", "created_at")
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    def matches(self, raw_key: str) -> bool:
        return hmac.compare_digest(self.hashed_key, hash_key(raw_key))


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
)


class UsageCountersQuerySet(models.QuerySet[Any]):
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

    def summarize(self, by: Sequence[str]) -> QuerySet[Any, dict[str, Any]]:
        """Sum the counters per value of the `by` dimensions (see USAGE_DIMENSIONS).

        Returns dicts with the dimension columns and one sum per counter; with
        no dimensions, one dict of grand totals (when there are rows).
        """
        columns = [USAGE_DIMENSIONS[name] for name in by]
        sums = {name: Sum(name) for name in COUNTER_FIELDS}
        return self.order_by().values(*columns).annotate(**sums).order_by(*columns)


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

    class Meta:
        abstract = True

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


class Endpoint(models.TextChoices):
    CHAT = "chat", "Chat completions"
    COMPLETIONS = "completions", "Completions"
    EMBEDDINGS = "embeddings", "Embeddings"


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
