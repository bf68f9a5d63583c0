"""Client API keys, and what each key spends per day.

``ApiKey`` is a client's credential (only a hash of the secret is stored) with
its limits, budgets and admission settings; its queryset creates, finds and
deactivates keys. ``KeySpend`` holds each key's requests, tokens and cost per
UTC day, which budgets are checked against and reports rank keys by.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import OuterRef, Subquery, Sum
from django.utils import timezone

from nexus_lib.model_patterns import is_valid_pattern, split_patterns
from usage.limits.policy import BudgetPeriod, period_id
from usage.models.limit_fields import (
    budget_period_field,
    budget_tokens_field,
    budget_usd_field,
    max_concurrency_field,
    rate_field,
    usd_to_nanos,
)
from usage.models.prices import nanos_to_usd
from usage.signals import api_keys_changed

if TYPE_CHECKING:
    from usage.models.teams import Team

KEY_SCHEME = "nx-"
PREFIX_LENGTH = len(KEY_SCHEME) + 8


def hash_key(raw_key: str) -> str:
    """Return the stored form of a client key (SHA-256; keys are 256-bit random)."""
    return hashlib.sha256(raw_key.encode()).hexdigest()


class ApiKeyQuerySet(models.QuerySet["ApiKey"]):
    def active(self) -> ApiKeyQuerySet:
        return self.filter(is_active=True)

    def create_key(
        self, name: str, team: Team | None = None, **limits: Any
    ) -> tuple[ApiKey, str]:
        """Create a key; return it with the raw secret, which is not stored.

        ``limits`` sets any of the key's limit, budget and admission fields
        (SETTING_FIELDS); ``team`` the team it belongs to.
        """
        unknown = set(limits) - set(SETTING_FIELDS)
        if unknown:
            raise TypeError(f"not a limit field: {', '.join(sorted(unknown))}")
        raw = f"{KEY_SCHEME}{secrets.token_urlsafe(32)}"
        key = self.model(
            name=name,
            prefix=raw[:PREFIX_LENGTH],
            hashed_key=hash_key(raw),
            team=team,
            **limits,
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

    def visible_to(self, user: Any) -> ApiKeyQuerySet:
        """The keys `user` sees: all for a global role, their teams' keys for a
        team admin (usage.models.teams)."""
        if user.has_perm("usage.view_all_teams"):
            return self
        return self.filter(team__admins=user)

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
    max_concurrency = max_concurrency_field(
        "Requests in flight at once, gateway-wide; empty: no limit."
    )
    rpm_limit = rate_field("requests per minute", "Empty: no limit.")
    tpm_limit = rate_field(
        "tokens per minute", "Prompt and completion tokens; empty: no limit."
    )
    budget_period = budget_period_field(
        "What the budgets cover: the current UTC day, month, or all time."
    )
    budget_tokens = budget_tokens_field(
        "Tokens this key may use per budget period; empty: no limit."
    )
    budget_usd = budget_usd_field(
        "Spend (at the model prices) per budget period; empty: no limit."
    )
    team = models.ForeignKey(
        "usage.Team",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="keys",
        help_text="The team whose limits and budgets this key also draws on "
        "(on top of its own).",
    )
    can_manage_models = models.BooleanField(
        "may manage Ollama models",
        default=False,
        help_text="Pull, push, copy, create and delete models on Ollama backends "
        "through the gateway's /api/pull, /api/push, /api/copy, /api/create and "
        "/api/delete.",
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
        return usd_to_nanos(self.budget_usd)

    def is_expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (
            now or timezone.now()
        )

    def spend(self, now: datetime | None = None) -> dict[str, Any]:
        """Rolled-up requests, tokens and cost (nano-USD) of the current budget
        period and of all time, with what is left of the budgets."""
        return summarize_spend(
            KeySpend.objects.filter(api_key_prefix=self.prefix),
            self.budget_period,
            self.budget_tokens,
            self.budget_nanos,
            now,
        )


def summarize_spend(
    rows: KeySpendQuerySet,
    budget_period: str,
    budget_tokens: int | None,
    budget_nanos: int | None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Requests, tokens and cost of `rows` in the budget period that holds now
    and of all time, with what is left of the budgets (None: no budget)."""
    moment = now or timezone.now()
    period: dict[str, Any] = {**rows.for_period(budget_period, moment).totals()}
    period["period"] = period_id(budget_period, moment.timestamp())
    period["remaining_tokens"] = (
        None
        if budget_tokens is None
        else max(budget_tokens - period["total_tokens"], 0)
    )
    period["remaining_nanos"] = (
        None if budget_nanos is None else max(budget_nanos - period["cost_nanos"], 0)
    )
    return {"period": period, "all_time": rows.totals()}


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
# What a key may do besides inference (off unless granted).
PERMISSION_FIELDS = ("can_manage_models",)
# Everything an operator sets on a key besides its name (the API's fields too).
SETTING_FIELDS = (
    *LIMIT_FIELDS,
    "admission_weight",
    "max_criticality",
    *PERMISSION_FIELDS,
)


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

    def top_teams(self, limit: int = 20) -> list[dict[str, Any]]:
        """Requests, tokens and cost per team (of its keys now) over these rows,
        most cost first, with each team (keys in no team are left out)."""
        from usage.models.teams import Team

        team_of = ApiKey.objects.filter(prefix=OuterRef("api_key_prefix"))
        rows: list[dict[str, Any]] = list(
            self.order_by()  # type: ignore[arg-type]
            .annotate(team_pk=Subquery(team_of.values("team_id")[:1]))
            .exclude(team_pk=None)
            .values("team_pk")
            .annotate(
                requests=Sum("requests"),
                total_tokens=Sum("total_tokens"),
                cost_nanos=Sum("cost_nanos"),
            )
            .order_by("-cost_nanos", "-total_tokens", "team_pk")[:limit]
        )
        teams = Team.objects.in_bulk([row["team_pk"] for row in rows])
        for row in rows:
            row["team"] = teams.get(row["team_pk"])
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
