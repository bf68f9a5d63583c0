"""Admin for aliases, fallback chains and the routing policy singleton."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.forms import BaseModelFormSet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html

import routing.history.admin  # noqa: F401  (registers the configuration history)
from routing.cache_purge import cache_report, purge_cache
from routing.core import FLEET_SETTING_NAMES, RouterSnapshot
from routing.models import Alias, ChainStep, FallbackChain, RoutingPolicy
from routing.snapshot import build_snapshot

if TYPE_CHECKING:
    # django-stubs makes the admin classes generic; Django's are not subscriptable.
    AliasAdminBase = admin.ModelAdmin[Alias]
    FallbackChainAdminBase = admin.ModelAdmin[FallbackChain]
    RoutingPolicyAdminBase = admin.ModelAdmin[RoutingPolicy]
    ChainStepInlineBase = admin.TabularInline[ChainStep, FallbackChain]
    ChainStepFormBase = forms.ModelForm[ChainStep]
else:
    ChainStepFormBase = forms.ModelForm
    AliasAdminBase = FallbackChainAdminBase = RoutingPolicyAdminBase = admin.ModelAdmin
    ChainStepInlineBase = admin.TabularInline


class AliasChangeList(ChangeList):
    """The alias list, each row judged against the routing configuration."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        snapshot = build_snapshot()
        for alias in self.result_list:
            alias.serves = describe_alias_route(snapshot, alias.name)


def describe_alias_route(snapshot: RouterSnapshot, name: str) -> str:
    """The model a request for alias `name` is served by, as the router tries
    them (target, then fallback chains) and with how it gets there; "" when no
    enabled backend serves any of them (the alias answers 404)."""
    if name in snapshot.aliases:
        models = snapshot.models_for(name)[1:]  # after the name itself
    elif name in snapshot.alias_patterns.targets:
        models = snapshot.models_for(name)
    else:
        return ""  # left out of routing (alias_problems says why)
    for position, model in enumerate(models):
        routes = snapshot.routes.get(model)
        if routes is not None and routes.is_served:
            return model if position == 0 else f"{model} (fallback)"
    return ""


@admin.register(Alias)
class AliasAdmin(AliasAdminBase):
    list_display = ("name", "kind", "target", "routes", "serves", "updated_at")
    search_fields = ("name", "target")
    readonly_fields = ("created_at", "updated_at")
    fields = ("name", "target", "created_at", "updated_at")

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return AliasChangeList

    def get_form(
        self,
        request: HttpRequest,
        obj: Alias | None = None,
        change: bool = False,
        **kwargs: Any,
    ) -> type[forms.ModelForm[Alias]]:
        kwargs["help_texts"] = {
            "name": "The name clients ask for, e.g. gpt-4; or a pattern with * "
            "(any characters) and ? (one character), e.g. claude-*, covering "
            "every name no backend serves and no exact alias names (the "
            "longest pattern first).",
        }
        return super().get_form(request, obj, change, **kwargs)

    @admin.display(description="kind")
    def kind(self, obj: Alias) -> str:
        return "pattern" if obj.is_pattern else "exact"

    @admin.display(description="routes", boolean=True)
    def routes(self, obj: Alias) -> bool:
        """Whether an enabled backend serves the target or a model of its
        fallback chain: if none does, the alias answers 404."""
        return bool(getattr(obj, "serves", ""))

    @admin.display(description="served by")
    def serves(self, obj: Alias) -> str:
        return getattr(obj, "serves", "") or "-"

    def save_model(
        self, request: HttpRequest, obj: Alias, form: Any, change: bool
    ) -> None:
        super().save_model(request, obj, form, change)
        if describe_alias_route(build_snapshot(), obj.name):
            return
        asked = f"names matching '{obj.name}'" if obj.is_pattern else f"'{obj.name}'"
        listed = "" if obj.is_pattern else " and /v1/models does not list it"
        self.message_user(
            request,
            f"No enabled backend serves '{obj.target}' (nor a model of its "
            f"fallback chain) yet: requests for {asked} get 404 "
            f"model_not_found{listed} until one does.",
            messages.WARNING,
        )


class ChainStepForm(ChainStepFormBase):
    """A fallback row: the step number is optional and renumbered on save."""

    step = forms.IntegerField(
        required=False,
        min_value=1,
        help_text="Leave empty to add it after the others; type a number to move it.",
        widget=forms.NumberInput(attrs={"class": "vIntegerField", "min": 1}),
    )

    class Meta:
        model = ChainStep
        fields = ("model",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            self.fields["step"].initial = self.instance.position + 1


class ChainStepInline(ChainStepInlineBase):
    model = ChainStep
    form = ChainStepForm
    fields = ("step", "model")
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

    def save_formset(
        self,
        request: HttpRequest,
        form: forms.ModelForm[FallbackChain],
        formset: BaseModelFormSet[Any, Any],
        change: bool,
    ) -> None:
        super().save_formset(request, form, formset, change)
        if formset.model is ChainStep:
            renumber_steps(formset)

    @admin.display(description="tried in order")
    def chain(self, obj: FallbackChain) -> str:
        return " → ".join((obj.model, *obj.fallback_models))


def renumber_steps(formset: BaseModelFormSet[Any, Any]) -> None:
    """Number a chain's saved steps 1, 2, 3... in the order the operator gave.

    A row with a step number goes to that place, a row without one after the
    numbered rows, in the order shown; gaps and ties close up.
    """
    deleted = set(formset.deleted_forms) if formset.can_delete else set()
    rows = [
        (form.cleaned_data.get("step") or math.inf, index, form.instance)
        for index, form in enumerate(formset.forms)
        if form.instance.pk is not None and form not in deleted
    ]
    rows.sort(key=lambda row: (row[0], row[1]))
    for position, (_, _, step) in enumerate(rows):
        if step.position != position:
            ChainStep.objects.filter(pk=step.pk).update(position=position)


@admin.register(RoutingPolicy)
class RoutingPolicyAdmin(RoutingPolicyAdminBase):
    """The policy is one row: its list page opens that row; none is added or deleted."""

    fieldsets = (
        (None, {"fields": ("strategy", "max_retries")}),
        (
            "Context shift",
            {
                "fields": (
                    "context_shift_enabled",
                    "context_shift_keep_last_messages",
                    "context_shift_max_retries",
                ),
                "description": "A chat that overflows a model's context is "
                "trimmed (oldest messages first) and resent.",
            },
        ),
        (
            "Prompt caching",
            {
                "fields": ("cache_anthropic_auto_breakpoints",),
                "description": "Anthropic backends cache a prompt's prefix up to "
                "each breakpoint (docs/caching.md).",
            },
        ),
        (
            "Response cache",
            {
                "fields": (
                    "cache_enabled",
                    "cache_ttl_seconds",
                    "cache_scope",
                    "cache_max_entry_bytes",
                    "cache_only_deterministic",
                    "cache_overview",
                ),
                "description": "Answer a repeated request from the cache "
                "(docs/caching.md).",
            },
        ),
        (
            "Multiple opinions",
            {
                "fields": (
                    "ensemble_opinions",
                    "ensemble_step_timeout_seconds",
                    "ensemble_critique_prompt",
                    "ensemble_refine_prompt",
                ),
                "description": "A request for moe-<model> asks several backends "
                "serving the model, has each critique the others' answers, and "
                "answers with the best one refined by its backend.",
            },
        ),
        (
            "Prefix-aware routing",
            {
                "fields": (
                    "prefix_enabled",
                    "prefix_block_chars",
                    "prefix_max_imbalance",
                    "prefix_max_imbalance_ratio",
                    "prefix_cache_blocks",
                    "prefix_session_keys",
                    "prefix_session_ttl_seconds",
                ),
                "description": "A request whose prompt starts like a recent one "
                "goes to the backend that computed it, and a session to its "
                "backend, unless that backend is busier than the least busy by "
                "more than the load guard (docs/prefix.md).",
            },
        ),
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
                    "admission_model_output_tokens",
                    "admission_watermark_per_backend",
                    "admission_percentage_deviation_for_bounds",
                    "admission_lower_bound_per_backend",
                    "admission_upper_bound_per_backend",
                    "admission_total_capacity",
                    "admission_flow_capacity",
                    "admission_critical_reserved",
                    "admission_queue_ttl",
                    "admission_model_weights",
                    "admission_critical_share",
                    "admission_default_share",
                    "admission_sheddable_share",
                    "admission_stock_unit",
                    "admission_watermark_tokens_per_backend",
                ),
                "description": "When a model's pool (its requests, against "
                "its ready backends) has more requests in flight than the band "
                "allows, new requests wait in Nexus's fair queue instead of "
                "piling up in the model servers. The band is the watermark per "
                "ready backend ± the deviation, or the explicit bounds; a "
                "backend with a max concurrency counts exactly that.",
            },
        ),
        (
            "Fleet strategy",
            {
                "fields": FLEET_SETTING_NAMES,
                "classes": ("collapse",),
                "description": "Used by the fleet strategy: the points each of "
                "the seven signals gives (thermal state, memory fit, queue depth, "
                "estimated wait, role affinity, availability trend, context fit) "
                "and the fleet queues' settings. An empty hold seconds means 30 "
                "under the fleet strategy and 0 under the others. Environment "
                "variables NEXUS_ROUTING_FLEET_<SETTING> override these.",
            },
        ),
        ("Record", {"fields": ("updated_at",)}),
    )
    readonly_fields = ("updated_at", "cache_overview")

    def has_add_permission(self, request: HttpRequest) -> bool:
        # The list page creates the row on first visit, so there is never one to add.
        return False

    @admin.display(description="Hit rates and purge")
    def cache_overview(self, obj: RoutingPolicy) -> str:
        url = reverse(f"{self.admin_site.name}:routing_routingpolicy_cache")
        return format_html('<a href="{}">Response cache: hits, purge</a>', url)

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.cache_view)
        own = [path("cache/", view, name="routing_routingpolicy_cache")]
        return own + super().get_urls()

    def cache_view(self, request: HttpRequest) -> HttpResponse:
        """Hit rate and tokens saved per model and per key; the purge."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            if not self.has_change_permission(request):
                raise PermissionDenied
            what = request.POST.get("purge", "")
            model = request.POST.get("model", "").strip() if what == "model" else ""
            key = request.POST.get("key", "").strip() if what == "key" else ""
            if what in ("model", "key") and not (model or key):
                self.message_user(
                    request, f"Name the {what} to purge.", messages.WARNING
                )
            else:
                purge_cache(model=model, key_prefix=key)
                whose = f"model {model}" if model else f"key {key}" if key else "all"
                self.message_user(
                    request,
                    f"Purged the cached answers ({whose}); every serving process "
                    "stops serving them within its configuration poll interval.",
                    messages.SUCCESS,
                )
            return HttpResponseRedirect(request.path)
        policy = RoutingPolicy.load()
        context = {
            **self.admin_site.each_context(request),
            "title": "Response cache",
            "opts": self.model._meta,
            "policy": policy.cache_policy(),
            "policy_url": reverse(
                f"{self.admin_site.name}:routing_routingpolicy_change",
                args=(policy.pk,),
            ),
            **cache_report(),
        }
        return TemplateResponse(request, "admin/routing/cache.html", context)

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
