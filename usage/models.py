"""Client API keys and token usage aggregates."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime, timedelta

from django.db import models
from django.utils import timezone

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

    class Meta:
        abstract = True


class TokenUsage(UsageCounters):
    """All-time usage per backend × model × client key."""

    updated_at = models.DateTimeField(auto_now=True)

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


class UsageBucketQuerySet(models.QuerySet["UsageBucket"]):
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
