"""Admin for client API keys and the read-only usage tables."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.db.models import OuterRef, QuerySet, Subquery
from django.http import HttpRequest
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from usage.limits.policy import period_id
from usage.models import (
    ANONYMOUS,
    LIMIT_FIELDS,
    MANAGE_ALL_TEAMS,
    PERMISSION_FIELDS,
    ApiKey,
    ApiKeyQuerySet,
    KeySpend,
    ModelPrice,
    Team,
    TokenUsage,
    UsageBucket,
    describe_key,
    nanos_to_usd,
)
from usage.models.limit_fields import describe_budget

if TYPE_CHECKING:
    from django.contrib.admin.options import _FieldsetSpec

    # django-stubs makes the admin classes generic; Django's are not subscriptable.
    ApiKeyAdminBase = admin.ModelAdmin[ApiKey]
    ModelPriceAdminBase = admin.ModelAdmin[ModelPrice]
    UsageAdminBase = admin.ModelAdmin[TokenUsage | UsageBucket]
else:
    ApiKeyAdminBase = ModelPriceAdminBase = UsageAdminBase = admin.ModelAdmin

# Rows of the usage table on a key's page; the full list is one link away.
USAGE_ROWS_SHOWN = 20
LIMITS_FIELDSET: Any = (
    "Allowed models, limits and budgets",
    {
        "fields": (
            "allowed_models",
            "expires_at",
            ("rpm_limit", "tpm_limit", "max_concurrency"),
            ("budget_period", "budget_tokens", "budget_usd"),
        ),
        "description": "Empty fields mean no limit. Limits hold for the whole "
        "gateway in production mode and per serving process in the embedded "
        "default (see docs/tenancy.md).",
    },
)


PERMISSIONS_FIELDSET: Any = (
    "Permissions",
    {
        "fields": PERMISSION_FIELDS,
        "description": "What this key may do besides inference.",
    },
)


def _usage_url(admin_site: admin.AdminSite, prefix: str) -> str:
    changelist = reverse(f"{admin_site.name}:usage_tokenusage_changelist")
    return f"{changelist}?{urlencode({'api_key_prefix': prefix or ANONYMOUS})}"


@admin.register(ApiKey)
class ApiKeyAdmin(ApiKeyAdminBase):
    list_display = (
        "name",
        "prefix_label",
        "team",
        "is_active",
        "expires_at",
        "rpm_limit",
        "tpm_limit",
        "budget_label",
        "created_at",
        "last_used_at",
    )
    list_filter = ("is_active", "team", "budget_period", "can_manage_models")
    list_select_related = ("team",)
    search_fields = ("name", "prefix")
    actions = ("deactivate_keys",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[ApiKey]:
        """Every key for a global role; a team admin's teams' keys for them."""
        keys = super().get_queryset(request)
        assert isinstance(keys, ApiKeyQuerySet)
        return keys.visible_to(request.user)

    def formfield_for_foreignkey(
        self, db_field: Any, request: HttpRequest, **kwargs: Any
    ) -> Any:
        if db_field.name == "team":
            kwargs["queryset"] = Team.objects.visible_to(request.user)
            # A team admin's keys are in one of their teams.
            kwargs["required"] = not request.user.has_perm(f"usage.{MANAGE_ALL_TEAMS}")
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_fieldsets(
        self, request: HttpRequest, obj: ApiKey | None = None
    ) -> _FieldsetSpec:
        if obj is None:
            return [
                (
                    None,
                    {
                        "fields": ("name", "team"),
                        "description": "The key is generated when you save, and "
                        "shown once: Nexus stores only a hash of it.",
                    },
                ),
                LIMITS_FIELDSET,
                PERMISSIONS_FIELDSET,
            ]
        return [
            (
                None,
                {
                    "fields": (
                        "name",
                        "team",
                        "is_active",
                        "prefix",
                        "created_at",
                        "last_used_at",
                    )
                },
            ),
            (
                "Admission control",
                {
                    "fields": ("admission_weight", "max_criticality"),
                    "description": "How this key's requests share busy backends "
                    "with other keys' (the routing policy's fair queue).",
                },
            ),
            LIMITS_FIELDSET,
            PERMISSIONS_FIELDSET,
            ("Spend against the budget", {"fields": ("spend",)}),
            ("Usage", {"fields": ("usage",)}),
        ]

    def get_readonly_fields(
        self, request: HttpRequest, obj: ApiKey | None = None
    ) -> tuple[str, ...]:
        if obj is None:
            return ()
        return ("prefix", "created_at", "last_used_at", "spend", "usage")

    def save_model(
        self, request: HttpRequest, obj: ApiKey, form: Any, change: bool
    ) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        created, raw_key = ApiKey.objects.create_key(
            obj.name,
            team=obj.team,
            **{
                name: getattr(obj, name) for name in (*LIMIT_FIELDS, *PERMISSION_FIELDS)
            },
        )
        # The admin logs the addition and redirects using the instance it built,
        # so turn that instance into the row create_key saved.
        obj.pk = created.pk
        obj.refresh_from_db()
        obj._state.adding = False
        self.message_user(
            request,
            format_html(
                "The new key for “{}” is <code>{}</code> — copy it now: Nexus "
                "keeps only a hash, so it cannot be shown again.",
                obj.name,
                raw_key,
            ),
            messages.WARNING,
        )

    @admin.display(description="prefix", ordering="prefix")
    def prefix_label(self, obj: ApiKey) -> str:
        return f"{obj.prefix}…"

    @admin.display(description="budget")
    def budget_label(self, obj: ApiKey) -> str:
        return describe_budget(obj.budget_tokens, obj.budget_usd, obj.budget_period)

    @admin.display(description="spend this period")
    def spend(self, obj: ApiKey) -> SafeString:
        """Rolled-up spend of the current budget period against the budgets."""
        now = timezone.now()
        rows = KeySpend.objects.filter(api_key_prefix=obj.prefix).for_period(
            obj.budget_period, now
        )
        tokens, nanos = rows.spend_by_key().get(obj.prefix, (0, 0))
        period = period_id(obj.budget_period, now.timestamp())
        return format_html(
            "<p>{} tokens of {}; ${} of {} ({}, rolled-up usage; the last "
            "seconds are not in yet).</p><p>Limits: {} requests/min, {} "
            "tokens/min, {} at once.</p>",
            f"{tokens:,}",
            f"{obj.budget_tokens:,}" if obj.budget_tokens is not None else "no limit",
            f"{nanos_to_usd(nanos):.4f}",
            f"${obj.budget_usd}" if obj.budget_usd is not None else "no limit",
            period,
            obj.rpm_limit or "no limit",
            obj.tpm_limit or "no limit",
            obj.max_concurrency or "no limit",
        )

    @admin.display(description="usage")
    def usage(self, obj: ApiKey) -> SafeString:
        usage = TokenUsage.objects.for_series(key=obj.prefix)
        shown = list(usage.report(["backend", "model"])[:USAGE_ROWS_SHOWN])
        if not shown:
            return format_html("{}", "No usage recorded for this key yet.")
        totals = usage.totals()
        body = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
            "<td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    row["backend"],
                    row["model"],
                    row["requests"],
                    row["errors"],
                    row["prompt_tokens"],
                    row["completion_tokens"],
                    row["total_tokens"],
                    f"{row['cost_usd']:.4f}",
                )
                for row in shown
            ),
        )
        return format_html(
            "<table><thead><tr><th>backend</th><th>model</th><th>requests</th>"
            "<th>errors</th><th>prompt tokens</th><th>completion tokens</th>"
            "<th>total tokens</th><th>cost (USD)</th></tr></thead><tbody>{}"
            "</tbody></table><p>{} requests, {} errors, {} tokens, ${} in all. "
            '<a href="{}">All usage rows for this key</a></p>',
            body,
            totals["requests"],
            totals["errors"],
            totals["total_tokens"],
            f"{totals['cost_usd']:.4f}",
            _usage_url(self.admin_site, obj.prefix),
        )

    @admin.action(description="Deactivate selected API keys", permissions=("change",))
    def deactivate_keys(self, request: HttpRequest, queryset: ApiKeyQuerySet) -> None:
        count = queryset.deactivate()
        self.message_user(
            request, f"Deactivated {count} key{pluralize(count)}.", messages.SUCCESS
        )


@admin.register(ModelPrice)
class ModelPriceAdmin(ModelPriceAdminBase):
    list_display = (
        "model",
        "input_per_million",
        "output_per_million",
        "cached_input_per_million",
        "cache_write_per_million",
        "cache_hit_per_million",
        "batch_price_factor",
        "updated_at",
    )
    search_fields = ("model",)


class _SeriesFilter(admin.SimpleListFilter):
    """Filter usage by one series field, offering the values TokenUsage has seen.

    TokenUsage holds one row per series, so its distinct values are cheap to list,
    where scanning the per-minute buckets for them would not be.
    """

    field = ""

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        values = (
            TokenUsage.objects.order_by(self.field)
            .values_list(self.field, flat=True)
            .distinct()
        )
        return [(value, value) for value in values]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        return queryset.filter(**{self.field: value})


class BackendFilter(_SeriesFilter):
    title = "backend"
    parameter_name = field = "backend"


class ModelFilter(_SeriesFilter):
    title = "model"
    parameter_name = field = "model"


class ApiKeyFilter(_SeriesFilter):
    title = "API key"
    parameter_name = field = "api_key_prefix"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        prefixes = [prefix for prefix, _ in super().lookups(request, model_admin)]
        names = dict(
            ApiKey.objects.filter(prefix__in=prefixes).values_list("prefix", "name")
        )
        return [
            (prefix or ANONYMOUS, describe_key(prefix, names.get(prefix)))
            for prefix in prefixes
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        return queryset.filter(api_key_prefix="" if value == ANONYMOUS else value)


class UsageAdmin(UsageAdminBase):
    """Usage is written only by the usage pipeline: operators look, never touch."""

    search_fields = ("backend", "model", "api_key_prefix")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: object | None = None
    ) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: object | None = None
    ) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        keys = ApiKey.objects.filter(prefix=OuterRef("api_key_prefix"))
        # Key names ride along in the one list query instead of a lookup per row.
        rows: QuerySet[Any] = (
            super()
            .get_queryset(request)
            .annotate(
                key_name=Subquery(keys.values("name")[:1]),
                key_pk=Subquery(keys.values("pk")[:1]),
            )
        )
        return rows

    @admin.display(description="API key", ordering="api_key_prefix")
    def key(self, obj: TokenUsage | UsageBucket) -> SafeString | str:
        label = describe_key(obj.api_key_prefix, obj.key_name)  # type: ignore[union-attr]
        if obj.key_pk is None:  # type: ignore[union-attr]
            return label
        url = reverse(
            f"{self.admin_site.name}:usage_apikey_change",
            args=(obj.key_pk,),  # type: ignore[union-attr]
        )
        return format_html('<a href="{}">{}</a>', url, label)


@admin.register(TokenUsage)
class TokenUsageAdmin(UsageAdmin):
    list_display = (
        "backend",
        "model",
        "key",
        "requests",
        "errors",
        "prompt_tokens",
        "cache_read_tokens",
        "completion_tokens",
        "total_tokens",
        "updated_at",
    )
    list_filter = (BackendFilter, ModelFilter, ApiKeyFilter, "updated_at")


@admin.register(UsageBucket)
class UsageBucketAdmin(UsageAdmin):
    list_display = (
        "minute",
        "backend",
        "model",
        "key",
        "requests",
        "errors",
        "prompt_tokens",
        "cache_read_tokens",
        "completion_tokens",
        "total_tokens",
    )
    list_filter = (BackendFilter, ModelFilter, ApiKeyFilter, "minute")
    date_hierarchy = "minute"
    # Counting every bucket on each page view is the slow part on a big table.
    show_full_result_count = False


# Batch jobs' admin lives in its own module; importing it registers it.
# The teams' admin lives in its own module (this one is long enough).
from usage import (
    batch_admin,  # noqa: F401
    team_admin,  # noqa: F401
)
