"""Admin for teams: their shared limits and budgets, admins, keys and spend."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from usage.models import Team, nanos_to_usd
from usage.models.limit_fields import describe_budget

if TYPE_CHECKING:
    TeamAdminBase = admin.ModelAdmin[Team]
else:
    TeamAdminBase = admin.ModelAdmin


@admin.register(Team)
class TeamAdmin(TeamAdminBase):
    list_display = (
        "name",
        "key_count",
        "rpm_limit",
        "tpm_limit",
        "max_concurrency",
        "budget_label",
    )
    search_fields = ("name",)
    filter_horizontal = ("admins",)
    fieldsets = (
        (None, {"fields": ("name", "admins")}),
        (
            "Shared limits and budgets",
            {
                "fields": (
                    ("rpm_limit", "tpm_limit", "max_concurrency"),
                    ("budget_period", "budget_tokens", "budget_usd"),
                ),
                "description": "Every key of the team draws on these together, "
                "on top of its own limits; empty fields mean no limit "
                "(docs/tenancy.md).",
            },
        ),
        ("Keys and spend", {"fields": ("keys", "spend")}),
    )
    readonly_fields = ("keys", "spend")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Team]:
        teams = Team.objects.visible_to(request.user)
        return teams.annotate(key_count=Count("keys"))

    @admin.display(description="keys", ordering="key_count")
    def key_count(self, team: Team) -> int:
        return team.key_count  # type: ignore[attr-defined]

    @admin.display(description="budget")
    def budget_label(self, team: Team) -> str:
        return describe_budget(team.budget_tokens, team.budget_usd, team.budget_period)

    @admin.display(description="keys")
    def keys(self, team: Team) -> SafeString:
        rows = team.keys.order_by("name").values_list("name", "prefix", "is_active")
        if not rows:
            return format_html("{}", "No keys yet: choose this team on a key.")
        return format_html(
            "<ul>{}</ul>",
            format_html_join(
                "",
                "<li>{} ({}…){}</li>",
                (
                    (name, prefix, "" if active else " — inactive")
                    for name, prefix, active in rows
                ),
            ),
        )

    @admin.display(description="spend this period")
    def spend(self, team: Team) -> SafeString:
        period = team.spend()["period"]
        return format_html(
            "<p>{} tokens of {}; ${} of {} ({}, rolled-up usage of the team's "
            "keys; the last seconds are not in yet).</p>",
            f"{period['total_tokens']:,}",
            f"{team.budget_tokens:,}" if team.budget_tokens is not None else "no limit",
            f"{nanos_to_usd(period['cost_nanos']):.4f}",
            f"${team.budget_usd}" if team.budget_usd is not None else "no limit",
            period["period"],
        )
