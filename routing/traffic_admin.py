"""Admin for splits, shadows (and their comparisons) and hedging."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.db.models import Avg, Count, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from routing.models import Hedging, Shadow, ShadowComparison, SplitTarget, TrafficSplit
from routing.traffic import SHADOW_FIELDS
from usage.split_report import split_report

if TYPE_CHECKING:
    SplitAdminBase = admin.ModelAdmin[TrafficSplit]
    ShadowAdminBase = admin.ModelAdmin[Shadow]
    ComparisonAdminBase = admin.ModelAdmin[ShadowComparison]
    HedgingAdminBase = admin.ModelAdmin[Hedging]
    SplitTargetInlineBase = admin.TabularInline[SplitTarget, TrafficSplit]
else:
    SplitAdminBase = ShadowAdminBase = ComparisonAdminBase = HedgingAdminBase = (
        admin.ModelAdmin
    )
    SplitTargetInlineBase = admin.TabularInline

# The split page compares its sides over this window.
COMPARE_HOURS = 24
COMPARISONS_SHOWN = 50


class SplitTargetInline(SplitTargetInlineBase):
    model = SplitTarget
    extra = 2
    min_num = 1
    fields = ("position", "model", "weight")
    ordering = ("position", "id")


@admin.register(TrafficSplit)
class TrafficSplitAdmin(SplitAdminBase):
    list_display = ("name", "sticky", "targets_shown", "updated_at")
    search_fields = ("name", "targets__model")
    readonly_fields = ("sides_compared", "created_at", "updated_at")
    fields = ("name", "sticky", "sides_compared", "created_at", "updated_at")
    inlines = (SplitTargetInline,)

    def get_queryset(self, request: HttpRequest) -> QuerySet[TrafficSplit]:
        return super().get_queryset(request).prefetch_related("targets")

    @admin.display(description="targets (weight)")
    def targets_shown(self, obj: TrafficSplit) -> str:
        weights = obj.side_weights
        total = sum(weights.values()) or 1
        return ", ".join(
            f"{model} {weight} ({weight / total:.0%})"
            for model, weight in weights.items()
        )

    @admin.display(description=f"sides compared (last {COMPARE_HOURS} h)")
    def sides_compared(self, obj: TrafficSplit) -> SafeString | str:
        if obj.pk is None:
            return "-"
        since = timezone.now() - timedelta(hours=COMPARE_HOURS)
        sides = split_report(since, obj.name)
        if not sides:
            return "No requests yet."
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
            "<td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    side.side,
                    side.requests,
                    f"{side.errors} ({side.errors / side.requests:.0%})",
                    f"{side.p50_ms:.1f}",
                    f"{side.p95_ms:.1f}",
                    side.prompt_tokens,
                    side.completion_tokens,
                    f"{side.cost_usd:.4f}",
                )
                for side in sides
            ),
        )
        return format_html(
            '<table class="split-sides"><thead><tr><th>side</th><th>requests</th>'
            "<th>errors</th><th>p50 ms</th><th>p95 ms</th><th>prompt</th>"
            "<th>completion</th><th>cost (USD)</th></tr></thead>"
            "<tbody>{}</tbody></table>",
            rows,
        )


@admin.register(Shadow)
class ShadowAdmin(ShadowAdminBase):
    list_display = (
        "model",
        "shadow_model",
        "percent",
        "compared",
        "mean_similarity",
        "updated_at",
    )
    search_fields = ("model", "shadow_model")
    readonly_fields = ("comparisons_table", "created_at", "updated_at")
    fields = (*SHADOW_FIELDS, "comparisons_table", "created_at", "updated_at")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Shadow]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                compared_count=Count("comparisons"),
                similarity_mean=Avg("comparisons__similarity"),
            )
        )

    @admin.display(description="comparisons", ordering="compared_count")
    def compared(self, obj: Any) -> int:
        return int(getattr(obj, "compared_count", 0))

    @admin.display(description="mean similarity", ordering="similarity_mean")
    def mean_similarity(self, obj: Any) -> str:
        mean = getattr(obj, "similarity_mean", None)
        return "-" if mean is None else f"{mean:.2f}"

    @admin.display(description="comparisons (newest first)")
    def comparisons_table(self, obj: Shadow) -> SafeString | str:
        if obj.pk is None:
            return "-"
        comparisons = obj.comparisons.order_by("-created_at", "-id")[:COMPARISONS_SHOWN]
        if not comparisons:
            return "None yet: they appear a few seconds after mirrored requests."
        rows = format_html_join(
            "",
            '<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td>'
            "<td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    reverse("admin:routing_shadowcomparison_change", args=(c.pk,)),
                    c.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                    c.request_id,
                    f"{c.similarity:.2f}",
                    _maybe(c.tools_match),
                    _maybe(c.json_valid),
                    f"{c.primary_latency_ms:.0f} / {c.shadow_latency_ms:.0f}",
                    f"{c.primary_tokens} / {c.shadow_tokens}",
                    c.shadow_error or f"{c.primary_finish} / {c.shadow_finish}",
                )
                for c in comparisons
            ),
        )
        return format_html(
            '<table class="shadow-comparisons"><thead><tr><th>when</th>'
            "<th>request</th><th>similarity</th><th>tools match</th>"
            "<th>JSON valid</th><th>latency ms (client / shadow)</th>"
            "<th>tokens</th><th>finish or error</th></tr></thead>"
            "<tbody>{}</tbody></table>",
            rows,
        )


def _maybe(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


@admin.register(ShadowComparison)
class ShadowComparisonAdmin(ComparisonAdminBase):
    """Read only: both answers side by side."""

    list_display = (
        "created_at",
        "shadow",
        "request_id",
        "similarity",
        "primary_latency_ms",
        "shadow_latency_ms",
    )
    list_filter = ("shadow",)
    list_select_related = ("shadow",)
    search_fields = ("request_id",)
    fields = (
        "shadow",
        "request_id",
        "created_at",
        "similarity",
        "tools_match",
        "json_valid",
        "prompt",
        "side_by_side",
    )
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: ShadowComparison | None = None
    ) -> bool:
        return False

    @admin.display(description="answers")
    def side_by_side(self, obj: ShadowComparison) -> SafeString:
        return format_html(
            '<table class="side-by-side"><thead><tr><th>{} (client, {} ms, {} '
            "tokens, {})</th><th>{} (shadow, {} ms, {} tokens, {})</th></tr>"
            '</thead><tbody><tr><td><pre class="primary-answer">{}</pre></td>'
            '<td><pre class="shadow-answer">{}</pre></td></tr></tbody></table>',
            obj.primary_model,
            f"{obj.primary_latency_ms:.0f}",
            obj.primary_tokens,
            obj.primary_finish or "-",
            obj.shadow.shadow_model,
            f"{obj.shadow_latency_ms:.0f}",
            obj.shadow_tokens,
            obj.shadow_error or obj.shadow_finish or "-",
            obj.primary_answer,
            obj.shadow_answer,
        )


@admin.register(Hedging)
class HedgingAdmin(HedgingAdminBase):
    list_display = ("model", "after", "after_ms", "max_extra", "max_body_bytes")
    search_fields = ("model",)
    readonly_fields = ("created_at", "updated_at")
