"""Admin for backends and the models they serve."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.forms import BaseModelFormSet, ModelForm
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince

from backends.discovery import discover_models
from backends.forms import KEY_SET, NO_KEY, BackendAdminForm
from backends.health import CheckReport, check_all
from backends.models import (
    CAPABILITY_FIELDS,
    HEALTH_FIELDS,
    LOADED_FIELDS,
    MEMORY_FIELDS,
    PREFIX_CACHE_FIELDS,
    SIZE_FIELDS,
    Backend,
    BackendModel,
    BackendQuerySet,
    HealthStatus,
)
from nexus_lib import live_views

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


def render_badge(text: str, colour: str, title: str = "") -> SafeString:
    """Return a small coloured label for a changelist cell; `title` shows on hover."""
    if title:
        return format_html(
            '<span style="{}" title="{}">{}</span>',
            BADGE_STYLE.format(colour),
            title,
            text,
        )
    return format_html('<span style="{}">{}</span>', BADGE_STYLE.format(colour), text)


def is_clean_check(report: CheckReport) -> bool:
    """A healthy backend that answered this probe without complaint."""
    return report.status == HealthStatus.HEALTHY and not report.error


def describe_check(report: CheckReport) -> str:
    """One admin message line for a health check."""
    text = f"{report.name}: {report.status}"
    if report.status_changed:
        text += f" (was {report.previous_status})"
    if report.latency_ms is not None:
        text += f", {report.latency_ms:,.0f} ms"
    text += f", {report.models} model{'s' if report.models != 1 else ''}"
    if report.error:
        text += f" — {report.error}"
    if report.superseded:
        text += " (a concurrent check recorded this moment first)"
    return text


class BackendModelInline(BackendModelInlineBase):
    model = BackendModel
    fields = (
        "name",
        *CAPABILITY_FIELDS,
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
        "url_label",
        "kind_version",
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
    readonly_fields = (
        *HEALTH_FIELDS,
        "latency",
        "learned_memory",
        "prompt_cache_detail",
        "is_demo",
        "created_at",
        "updated_at",
    )
    actions = (
        "check_health_now",
        "discover_models_now",
        "drain",
        "undrain",
        "remove_demo_backends",
    )

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
            (
                "Fleet strategy",
                {
                    "fields": ("memory_ceiling_gb", "tier", "prefix_cache_tokens"),
                    "description": "What the fleet routing strategy weighs: a "
                    "model that is not loaded and does not fit under the memory "
                    "ceiling (else the memory the server reports) is not sent "
                    "here; the tier matches model sizes to machines.",
                },
            ),
        )
        if obj is None:
            return settings
        return (
            *settings,
            (
                "Learned capacity",
                {
                    "fields": ("learned_memory", "prompt_cache_detail"),
                    "description": "What the server last reported, read by "
                    "health checks. Out-of-memory load failures pause cold loads "
                    "in the serving process that saw them: see route explain and "
                    "the dashboard's fleet panel.",
                },
            ),
            (
                "Health",
                {
                    # The average latency rounded, as in the list.
                    "fields": tuple(
                        "latency" if name == "avg_latency_ms" else name
                        for name in HEALTH_FIELDS
                        if name not in MEMORY_FIELDS and name not in PREFIX_CACHE_FIELDS
                    ),
                    "description": "Updated by health checks.",
                },
            ),
            ("Record", {"fields": ("is_demo", "created_at", "updated_at")}),
        )

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        # Offered only while there are demo backends to remove.
        if not Backend.objects.filter(is_demo=True).exists():
            actions.pop("remove_demo_backends", None)
        return actions

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

    @admin.display(description="URL", ordering="base_url")
    def url_label(self, obj: Backend) -> SafeString:
        # Long URLs are cut short by the stylesheet; the whole one shows on hover.
        return format_html('<span title="{}">{}</span>', obj.base_url, obj.base_url)

    @admin.display(description="API key")
    def api_key_status(self, obj: Backend) -> str:
        return KEY_SET if obj.has_api_key else NO_KEY

    def save_formset(
        self,
        request: HttpRequest,
        form: ModelForm[Backend],
        formset: BaseModelFormSet[Any, Any],
        change: bool,
    ) -> None:
        if formset.model is BackendModel:
            for inline_form in formset.forms:
                if inline_form.has_changed():
                    inline_form.instance.claim_fields(inline_form.changed_data)
        super().save_formset(request, form, formset, change)

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Backend) -> SafeString:
        status = HealthStatus(obj.status)
        hover = obj.last_error
        if obj.consecutive_failures:
            failures = f"{obj.consecutive_failures} failed check(s) in a row"
            hover = f"{hover} ({failures})" if hover else failures
        badge = render_badge(status.label, STATUS_COLOURS[status], hover)
        paused = live_views.cold_load_pause(obj.name)
        if not paused and not obj.memory_pressure:
            return badge
        return format_html(
            '{}<br><small title="{}">cold loads paused</small>',
            badge,
            paused or obj.describe_memory(),
        )

    @admin.display(description="reported by the server")
    def learned_memory(self, obj: Backend) -> str:
        text = obj.describe_memory() or "Nothing reported yet."
        paused = live_views.cold_load_pause(obj.name)
        return f"{text} Cold loads paused: {paused}." if paused else text

    @admin.display(description="models", ordering="model_count")
    def model_count(self, obj: Backend) -> int:
        return obj.model_count  # type: ignore[attr-defined]

    @admin.display(description="prompt cache")
    def prompt_cache_detail(self, obj: Backend) -> str:
        parts = []
        rate = obj.prefix_cache_hit_rate
        if rate is not None:
            parts.append(
                f"{rate:.0%} of {obj.prefix_cache_queries:,} prompt tokens found "
                "in its cache (since the server started)"
            )
        if obj.prefix_cache_reported_tokens is not None:
            parts.append(f"holds {obj.prefix_cache_reported_tokens:,} tokens")
        return "; ".join(parts) or "Nothing reported yet."

    @admin.display(description="latency", ordering="avg_latency_ms")
    def latency(self, obj: Backend) -> str | SafeString:
        # The server's prompt cache hit rate under it, when it reports one:
        # one column, so the list fits 1280 px.
        text = "—" if obj.avg_latency_ms is None else f"{obj.avg_latency_ms:,.0f} ms"
        rate = obj.prefix_cache_hit_rate
        if rate is None:
            return text
        return format_html(
            "{}<br><small title=\"prompt tokens found in the server's prompt "
            'cache since it started">cache hits {}</small>',
            text,
            f"{rate:.0%}",
        )

    @admin.display(description="kind / version", ordering="kind")
    def kind_version(self, obj: Backend) -> SafeString:
        # One column, the version under the kind: the list fits 1280 px.
        kind = obj.get_kind_display()
        version = obj.server_version
        if not version:
            return format_html("{}", kind)
        shown = version if len(version) <= 16 else f"{version[:15]}…"
        return format_html(
            '{}<br><small title="{}" style="white-space:nowrap">{}</small>',
            kind,
            version,
            shown,
        )

    @admin.display(description="last check", ordering="last_check_at")
    def last_check_age(self, obj: Backend) -> str:
        if obj.last_check_at is None:
            return "never"
        return f"{timesince(obj.last_check_at)} ago"

    @admin.action(description="Check health now")
    def check_health_now(
        self, request: HttpRequest, queryset: QuerySet[Backend]
    ) -> None:
        pks = list(queryset.values_list("pk", flat=True))
        for report in check_all(pks, include_disabled=True):
            self.message_user(
                request,
                describe_check(report),
                messages.SUCCESS if is_clean_check(report) else messages.WARNING,
            )

    @admin.action(description="Discover models")
    def discover_models_now(
        self, request: HttpRequest, queryset: QuerySet[Backend]
    ) -> None:
        pks = list(queryset.values_list("pk", flat=True))
        for report in discover_models(pks, include_disabled=True):
            self.message_user(
                request,
                f"{report.name}: {report.summary()}",
                messages.SUCCESS if report.ok else messages.WARNING,
            )

    @admin.action(description="Drain (no new requests; requests in flight finish)")
    def drain(self, request: HttpRequest, queryset: QuerySet[Backend]) -> None:
        names = cast(BackendQuerySet, queryset).drain()
        for name in names:
            self.message_user(
                request, f"{name}: draining; it gets no new requests.", messages.SUCCESS
            )
        for name in queryset.exclude(name__in=names).values_list("name", flat=True):
            self.message_user(request, f"{name}: was already draining.", messages.INFO)

    @admin.action(description="Undrain (check health, then take requests again)")
    def undrain(self, request: HttpRequest, queryset: QuerySet[Backend]) -> None:
        pks = cast(BackendQuerySet, queryset).undrain()
        for report in check_all(pks, include_disabled=True):
            self.message_user(
                request,
                f"{report.name}: undrained; {describe_check(report)}",
                messages.SUCCESS if is_clean_check(report) else messages.WARNING,
            )
        for name in queryset.exclude(pk__in=pks).values_list("name", flat=True):
            self.message_user(request, f"{name}: was not draining.", messages.INFO)

    @admin.action(
        description="Remove demo backends (the selected ones nexus_run started)",
        permissions=("delete",),
    )
    def remove_demo_backends(
        self, request: HttpRequest, queryset: QuerySet[Backend]
    ) -> None:
        names, unserved = cast(BackendQuerySet, queryset).remove_demo()
        if not names:
            self.message_user(
                request,
                "None of the selected backends is a demo backend; nothing removed.",
                messages.WARNING,
            )
            return
        self.message_user(
            request,
            f"Removed demo backends {', '.join(names)}. nexus_run no longer "
            "starts them while you have backends of your own (NEXUS_DEMO=1 "
            "brings them back).",
            messages.SUCCESS,
        )
        if unserved:
            self.message_user(
                request,
                f"No enabled backend serves {', '.join(unserved)} now: aliases "
                "to them answer 404 model_not_found and fallback steps naming "
                'them find no backend (see the aliases\' "target served" '
                "column).",
                messages.WARNING,
            )
        kept = queryset.exclude(name__in=names).values_list("name", flat=True)
        if kept:
            self.message_user(
                request,
                f"Left alone (not demo backends): {', '.join(kept)}.",
                messages.INFO,
            )


@admin.register(BackendModel)
class BackendModelAdmin(BackendModelAdminBase):
    list_display = (
        "name",
        "backend",
        *CAPABILITY_FIELDS,
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
    readonly_fields = (
        "discovered",
        "manual_fields",
        "learned_context",
        *LOADED_FIELDS,
        "created_at",
        "updated_at",
    )
    fields = (
        "backend",
        "name",
        *CAPABILITY_FIELDS,
        "learned_context",
        *SIZE_FIELDS,
        "max_concurrency",
        "loaded",
        *LOADED_FIELDS,
        "enabled",
        "discovered",
        "manual_fields",
        "created_at",
        "updated_at",
    )
    actions = ("let_discovery_manage",)

    def save_model(
        self,
        request: HttpRequest,
        obj: BackendModel,
        form: ModelForm[BackendModel],
        change: bool,
    ) -> None:
        obj.claim_fields(form.changed_data)
        super().save_model(request, obj, form, change)

    @admin.display(description="context learned from overflows")
    def learned_context(self, obj: BackendModel) -> str:
        if obj.backend_id is None:
            return "—"
        learned = live_views.learned_context(
            obj.backend.name, obj.name, obj.context_length
        )
        if learned is None:
            return (
                "— (no context overflow seen by this serving process since the "
                "context length was last discovered)"
            )
        limit, n_ctx = learned
        said = f"; the server said n_ctx {n_ctx:,}" if n_ctx else ""
        return (
            f"{limit:,} tokens (Nexus's estimate){said}: requests are trimmed "
            "to it before they are sent (context shift)"
        )

    @admin.action(description="Let discovery manage the selected models' fields")
    def let_discovery_manage(
        self, request: HttpRequest, queryset: QuerySet[BackendModel]
    ) -> None:
        count = queryset.exclude(manual_fields=[]).update(manual_fields=[])
        self.message_user(
            request,
            f"Discovery now manages every field of {count} model(s); the next "
            "discovery run overwrites what was set by hand.",
            messages.SUCCESS,
        )


# Relay workers' admin lives in its own module; importing it registers it.
from backends import worker_admin  # noqa: F401
