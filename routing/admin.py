"""Admin for aliases, fallback chains and the routing policy singleton."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse

from routing.models import Alias, ChainStep, FallbackChain, RoutingPolicy

if TYPE_CHECKING:
    # django-stubs makes the admin classes generic; Django's are not subscriptable.
    AliasAdminBase = admin.ModelAdmin[Alias]
    FallbackChainAdminBase = admin.ModelAdmin[FallbackChain]
    RoutingPolicyAdminBase = admin.ModelAdmin[RoutingPolicy]
    ChainStepInlineBase = admin.TabularInline[ChainStep, FallbackChain]
else:
    AliasAdminBase = FallbackChainAdminBase = RoutingPolicyAdminBase = admin.ModelAdmin
    ChainStepInlineBase = admin.TabularInline


@admin.register(Alias)
class AliasAdmin(AliasAdminBase):
    list_display = ("name", "target", "updated_at")
    search_fields = ("name", "target")
    readonly_fields = ("created_at", "updated_at")
    fields = ("name", "target", "created_at", "updated_at")


class ChainStepInline(ChainStepInlineBase):
    model = ChainStep
    fields = ("position", "model")
    ordering = ("position", "id")
    extra = 3


@admin.register(FallbackChain)
class FallbackChainAdmin(FallbackChainAdminBase):
    inlines = (ChainStepInline,)
    list_display = ("model", "chain", "updated_at")
    search_fields = ("model", "steps__model")
    readonly_fields = ("created_at", "updated_at")
    fields = ("model", "created_at", "updated_at")

    def get_queryset(self, request: HttpRequest) -> QuerySet[FallbackChain]:
        return super().get_queryset(request).prefetch_related("steps")

    @admin.display(description="tried in order")
    def chain(self, obj: FallbackChain) -> str:
        return " → ".join((obj.model, *obj.fallback_models))


@admin.register(RoutingPolicy)
class RoutingPolicyAdmin(RoutingPolicyAdminBase):
    """The policy is one row: its list page opens that row; none is added or deleted."""

    fieldsets = (
        (None, {"fields": ("strategy", "max_retries")}),
        (
            "Scoring weights",
            {
                "fields": ("weight_priority", "weight_load", "weight_latency"),
                "description": "Used by the smart strategy; they must sum to 100.",
            },
        ),
        (
            "Admission control",
            {
                "fields": (
                    "admission_enabled",
                    "admission_flow_key",
                    "admission_sizing",
                    "admission_default_output_tokens",
                    "admission_watermark_per_backend",
                    "admission_percentage_deviation_for_bounds",
                    "admission_lower_bound_per_backend",
                    "admission_upper_bound_per_backend",
                    "admission_total_capacity",
                    "admission_flow_capacity",
                    "admission_critical_reserved",
                    "admission_queue_ttl",
                    "admission_model_weights",
                ),
                "description": "When a pool of backends (the ready backends "
                "serving a model) has more requests in flight than the band "
                "allows, new requests wait in Nexus's fair queue instead of "
                "piling up in the model servers. The band is the watermark per "
                "ready backend ± the deviation, or the explicit bounds.",
            },
        ),
        ("Record", {"fields": ("updated_at",)}),
    )
    readonly_fields = ("updated_at",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        # The list page creates the row on first visit, so there is never one to add.
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: RoutingPolicy | None = None
    ) -> bool:
        return False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        policy = RoutingPolicy.load()
        return HttpResponseRedirect(
            reverse(
                f"{self.admin_site.name}:routing_routingpolicy_change",
                args=(policy.pk,),
            )
        )
