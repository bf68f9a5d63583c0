"""Teams: a group of client keys with a shared pool of limits and budgets.

A key of a team is held to its own limits and, in the same admission, to its
team's: requests per minute, tokens per minute, requests in flight, and
budgets (tokens and/or money per UTC day, UTC month or all time) that every
key of the team draws on together. A team's admins (users scoped to it)
manage only its keys and see only its usage.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import models

from usage.models.keys import ApiKey, KeySpend, summarize_spend
from usage.models.limit_fields import (
    budget_period_field,
    budget_tokens_field,
    budget_usd_field,
    max_concurrency_field,
    rate_field,
    usd_to_nanos,
)

# The fields that limit a team's keys together (the API, TOML and commands).
TEAM_LIMIT_FIELDS = (
    "max_concurrency",
    "rpm_limit",
    "tpm_limit",
    "budget_period",
    "budget_tokens",
    "budget_usd",
)


# The global roles see every team's keys (viewer and up: VIEW_ALL_TEAMS) and
# key-admin and admin manage them all (MANAGE_ALL_TEAMS); a team admin has the
# key permissions without these, for the teams they administer only.
VIEW_ALL_TEAMS = "view_all_teams"
MANAGE_ALL_TEAMS = "manage_all_teams"


class TeamQuerySet(models.QuerySet["Team"]):
    def visible_to(self, user: Any) -> TeamQuerySet:
        """The teams `user` sees (and, with the permission, manages): all for a
        global role, a team admin's own teams for them."""
        if user.has_perm(f"usage.{VIEW_ALL_TEAMS}"):
            return self
        return self.filter(admins=user)


class Team(models.Model):
    """A group of client keys sharing limits and budgets on top of each key's own."""

    name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    admins = models.ManyToManyField(
        settings.AUTH_USER_MODEL,
        blank=True,
        related_name="administered_teams",
        help_text="Users with the team-admin role who manage this team's keys "
        "and see its usage (and nothing of other teams).",
    )
    max_concurrency = max_concurrency_field(
        "Requests in flight at once across the team's keys; empty: no limit."
    )
    rpm_limit = rate_field(
        "requests per minute", "Across the team's keys; empty: no limit."
    )
    tpm_limit = rate_field(
        "tokens per minute", "Across the team's keys; empty: no limit."
    )
    budget_period = budget_period_field(
        "What the team's budgets cover: the current UTC day, month, or all time."
    )
    budget_tokens = budget_tokens_field(
        "Tokens the team's keys may use together per budget period; empty: no limit."
    )
    budget_usd = budget_usd_field(
        "Spend of the team's keys together per budget period; empty: no limit."
    )

    objects = TeamQuerySet.as_manager()

    class Meta:
        ordering = ("name",)
        permissions = (
            (VIEW_ALL_TEAMS, "Can see the keys and usage of every team"),
            (MANAGE_ALL_TEAMS, "Can manage the keys of every team"),
        )

    def __str__(self) -> str:
        return self.name

    @property
    def budget_nanos(self) -> int | None:
        """The money budget in nano-USD (the unit costs are counted in)."""
        return usd_to_nanos(self.budget_usd)

    def spend(self, now: datetime | None = None) -> dict[str, Any]:
        """The team's keys' rolled-up requests, tokens and cost (nano-USD) of the
        current budget period and of all time, with what is left of the budgets."""
        rows = KeySpend.objects.filter(
            api_key_prefix__in=ApiKey.objects.filter(team=self).values("prefix")
        )
        return summarize_spend(
            rows, self.budget_period, self.budget_tokens, self.budget_nanos, now
        )
