"""The fields of a set of limits and budgets: a client key's, and a team's.

Both models declare the same columns with their own help texts; these build
them, so the two cannot drift apart.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.core.validators import MinValueValidator
from django.db import models

from usage.limits.policy import NANOS_PER_USD, BudgetPeriod


def max_concurrency_field(help_text: str) -> Any:
    return models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text=help_text
    )


def rate_field(verbose_name: str, help_text: str) -> Any:
    """Requests or tokens per minute (None: no limit)."""
    return models.PositiveIntegerField(
        verbose_name,
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text=help_text,
    )


def budget_period_field(help_text: str) -> Any:
    return models.CharField(
        max_length=8,
        choices=BudgetPeriod.choices(),
        default=BudgetPeriod.MONTH,
        help_text=help_text,
    )


def budget_tokens_field(help_text: str) -> Any:
    return models.PositiveBigIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text=help_text
    )


def budget_usd_field(help_text: str) -> Any:
    return models.DecimalField(
        "budget (USD)",
        max_digits=14,
        decimal_places=4,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0.0001"))],
        help_text=help_text,
    )


def usd_to_nanos(usd: Decimal | None) -> int | None:
    """A money budget in nano-USD (the unit costs are counted in)."""
    return None if usd is None else int(usd * NANOS_PER_USD)


def describe_budget(tokens: int | None, usd: Decimal | None, period: str) -> str:
    """A budget as the admin lists show it: "5,000 tokens + $12.5 / month"."""
    parts = []
    if tokens is not None:
        parts.append(f"{tokens:,} tokens")
    if usd is not None:
        parts.append(f"${usd}")
    return f"{' + '.join(parts)} / {period}" if parts else "-"
