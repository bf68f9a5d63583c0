"""Admin for backends and the models they serve."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince

from backends.forms import KEY_SET, NO_KEY, BackendAdminForm
from backends.models import Backend, BackendModel, BackendQuerySet, HealthStatus

if TYPE_CHECKING:
    from django.contrib.admin.options import _FieldsetSpec

    # django-stubs makes the admin classes generic; Django's are not subscriptable.
    BackendAdminBase = admin.ModelAdmin[Backend]
    BackendModelAdminBase = admin.ModelAdmin[BackendModel]
    BackendModelInlineBase = admin.TabularInline[BackendModel, Backend]
else:
    BackendAdminBase = BackendModelAdminBase = admin.ModelAdmin
    BackendModelInlineBase = admin.TabularInline

STATUS_COLOURS = {
    HealthStatus.UNKNOWN: "#6c757d",
    HealthStatus.HEALTHY: "#198754",
    HealthStatus.UNHEALTHY: "#dc3545",
    HealthStatus.DRAINING: "#b8860b",
}
BADGE_STYLE = (
    "display:inline-block;padding:1px 7px;border-radius:8px;color:#fff;"
    "font-size:11px;font-weight:bold;background:{}"
)
HEALTH_FIELDS = (
    "status",
    "last_check_at",
    "last_error",
    "consecutive_failures",
    "consecutive_successes",
    "avg_latency_ms",
)


def render_badge(text: str, colour: str) -> SafeString:
    """Return a small coloured label for a changelist cell."""
    return format_html('<span style="{}">{}</span>', BADGE_STYLE.format(colour), text)


class BackendModelInline(BackendModelInlineBase):
    model = BackendModel
    fields = (
        "name",
        "context_length",
        "supports_vision",
        "supports_tools",
        "supports_json_mode",
        "loaded",
        "discovered",
        "enabled",
    )
    readonly_fields = ("discovered",)
    extra = 1
    show_change_link = True


@admin.register(Backend)
class BackendAdmin(BackendAdminBase):
    form = BackendAdminForm
    inlines = (BackendModelInline,)
    list_display = (
        "name_label",
        "kind",
        "status_badge",
        "enabled",
        "priority",
        "model_count",
        "latency",
        "last_check_age",
    )
    list_display_links = ("name_label",)
    list_editable = ("enabled", "priority")
    list_filter = ("status", "kind", "enabled", "is_demo")
    search_fields = ("name", "base_url")
    ordering = ("priority", "name")
    readonly_fields = (*HEALTH_FIELDS, "is_demo", "created_at", "updated_at")

    def get_fieldsets(
        self, request: HttpRequest, obj: Backend | None = None
    ) -> _FieldsetSpec:
        credentials: tuple[str, ...] = ("api_key",)
        if obj is not None and not self.has_change_permission(request, obj):
            # A view-only page prints the value of every field it lists.
            credentials = ("api_key_status",)
        elif obj is not None and obj.has_api_key:
            # Offer to clear only a key that exists.
            credentials = ("api_key", "clear_api_key")
        settings: _FieldsetSpec = (
            (None, {"fields": ("name", "base_url", "kind", "enabled", "priority")}),
            ("Credentials", {"fields": credentials}),
            ("Limits", {"fields": ("max_concurrency", "request_timeout")}),
        )
        if obj is None:
            return settings
        return (
            *settings,
            (
                "Health",
                {"fields": HEALTH_FIELDS, "description": "Updated by health checks."},
            ),
            ("Record", {"fields": ("is_demo", "created_at", "updated_at")}),
        )

    def get_changelist_form(
        self, request: HttpRequest, **kwargs: Any
    ) -> type[ModelForm[Backend]]:
        # Build the list's row form from the editable columns only, not every field.
        kwargs.setdefault("fields", self.list_editable)
        return super().get_changelist_form(request, **kwargs)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Backend]:
        backends = cast(BackendQuerySet, super().get_queryset(request))
        return backends.with_model_count()

    @admin.display(description="name", ordering="name")
    def name_label(self, obj: Backend) -> SafeString:
        if obj.is_demo:
            return format_html(
                '<span style="white-space:nowrap">{} {}</span>',
                obj.name,
                render_badge("DEMO", "#6f42c1"),
            )
        return format_html('<span style="white-space:nowrap">{}</span>', obj.name)

    @admin.display(description="API key")
    def api_key_status(self, obj: Backend) -> str:
        return KEY_SET if obj.has_api_key else NO_KEY

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Backend) -> SafeString:
        status = HealthStatus(obj.status)
        return render_badge(status.label, STATUS_COLOURS[status])

    @admin.display(description="models", ordering="model_count")
    def model_count(self, obj: Backend) -> int:
        return obj.model_count  # type: ignore[attr-defined]

    @admin.display(description="avg latency", ordering="avg_latency_ms")
    def latency(self, obj: Backend) -> str:
        if obj.avg_latency_ms is None:
            return "—"
        return f"{obj.avg_latency_ms:,.0f} ms"

    @admin.display(description="last check", ordering="last_check_at")
    def last_check_age(self, obj: Backend) -> str:
        if obj.last_check_at is None:
            return "never"
        return f"{timesince(obj.last_check_at)} ago"


@admin.register(BackendModel)
class BackendModelAdmin(BackendModelAdminBase):
    list_display = (
        "name",
        "backend",
        "context_length",
        "supports_vision",
        "supports_tools",
        "supports_json_mode",
        "loaded",
        "discovered",
        "enabled",
    )
    list_filter = (
        "enabled",
        "loaded",
        "discovered",
        "supports_vision",
        "supports_tools",
        "supports_json_mode",
        "backend",
    )
    search_fields = ("name", "backend__name")
    list_select_related = ("backend",)
    autocomplete_fields = ("backend",)
    readonly_fields = ("discovered", "created_at", "updated_at")
    fields = (
        "backend",
        "name",
        "context_length",
        "supports_vision",
        "supports_tools",
        "supports_json_mode",
        "loaded",
        "enabled",
        "discovered",
        "created_at",
        "updated_at",
    )
