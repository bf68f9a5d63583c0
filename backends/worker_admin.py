"""Admin for relay workers: create (the secret shown once), rotate, revoke, drain."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.timesince import timesince

from backends.workers import DEFAULT_DRAIN_SECONDS, MODEL_RULE_FIELDS, Worker

if TYPE_CHECKING:
    WorkerAdminBase = admin.ModelAdmin[Worker]
else:
    WorkerAdminBase = admin.ModelAdmin


def _show_secret(request: HttpRequest, worker: Worker, raw: str, what: str) -> None:
    messages.success(
        request,
        format_html(
            "{} for worker “{}”: <code>{}</code> — copy it now, it will not be "
            "shown again. On the worker: <code>nexus-worker --server "
            "http://GATEWAY:8000 --secret {} --backend http://127.0.0.1:11434</code>",
            what,
            worker.name,
            raw,
            raw,
        ),
    )


@admin.register(Worker)
class WorkerAdmin(WorkerAdminBase):
    list_display = (
        "name",
        "prefix",
        "is_active",
        "connection",
        "backend_status",
        "last_seen",
        "last_address",
        "allowed",
        "created_at",
    )
    list_filter = ("is_active", "may_shadow_direct_backends")
    search_fields = ("name", "prefix")
    list_select_related = ("backend",)
    fields = (
        "name",
        "prefix",
        "is_active",
        *MODEL_RULE_FIELDS,
        "refused",
        "backend",
        "last_seen_at",
        "last_address",
        "created_at",
    )
    actions = ("drain_workers", "refresh_models", "rotate_secrets", "revoke_workers")

    def get_readonly_fields(
        self, request: HttpRequest, obj: Worker | None = None
    ) -> tuple[str, ...]:
        readonly = (
            "prefix",
            "is_active",
            "refused",
            "backend",
            "last_seen_at",
            "last_address",
            "created_at",
        )
        # The name is the backend's name in routing: fixed once created.
        return readonly if obj is None else ("name", *readonly)

    def get_fields(
        self, request: HttpRequest, obj: Worker | None = None
    ) -> tuple[str, ...]:
        return ("name", *MODEL_RULE_FIELDS) if obj is None else self.fields

    def save_model(
        self, request: HttpRequest, obj: Worker, form: ModelForm[Worker], change: bool
    ) -> None:
        if change:
            # Only what the form changed: the worker's consumer writes its
            # connection fields meanwhile, which a whole-row save would put back.
            changed = [f for f in MODEL_RULE_FIELDS if f in form.changed_data]
            if changed:
                obj.save(update_fields=changed)
                obj.refresh_models_on_commit()
            return
        raw = obj.set_new_secret()
        super().save_model(request, obj, form, change)
        _show_secret(request, obj, raw, "Secret")

    def has_delete_permission(
        self, request: HttpRequest, obj: Worker | None = None
    ) -> bool:
        # Revoke instead: a deleted worker's socket would stay open until its
        # next heartbeat, and its backend's usage history keeps its name.
        return False

    @admin.display(description="connected")
    def connection(self, obj: Worker) -> SafeString:
        return format_html("{}", "yes" if obj.is_connected else "no")

    @admin.display(description="backend status")
    def backend_status(self, obj: Worker) -> str:
        return str(obj.backend.status) if obj.backend is not None else "—"

    @admin.display(description="allowed models")
    def allowed(self, obj: Worker) -> str:
        rules = obj.allowed_models.replace(",", ", ") or "any"
        return rules + (
            " (may shadow direct backends)" if obj.may_shadow_direct_backends else ""
        )

    @admin.display(description="refused models")
    def refused(self, obj: Worker) -> SafeString | str:
        if not obj.refused_models:
            return "none"
        return format_html_join(
            mark_safe("<br>"),
            "{} ({})",
            (
                (row.get("name", ""), row.get("reason", ""))
                for row in obj.refused_models
            ),
        )

    @admin.display(description="last seen", ordering="last_seen_at")
    def last_seen(self, obj: Worker) -> str:
        if obj.last_seen_at is None:
            return "never"
        return f"{timesince(obj.last_seen_at)} ago"

    @admin.action(description="Drain worker (finish requests in flight, then exit)")
    def drain_workers(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        workers = Worker.objects.filter(pk__in=queryset.values("pk"))
        told = workers.drain(DEFAULT_DRAIN_SECONDS)
        if told:
            self.message_user(
                request,
                f"Draining {', '.join(told)}: no new requests; requests in flight "
                f"finish (up to {DEFAULT_DRAIN_SECONDS:g} s), then the worker exits.",
            )
        else:
            self.message_user(
                request, "None of these workers is connected.", messages.WARNING
            )

    @admin.action(description="Refresh models (the worker lists them again)")
    def refresh_models(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        told = Worker.objects.filter(pk__in=queryset.values("pk")).refresh_models()
        self.message_user(
            request,
            f"Asked {', '.join(told)} to list their models again."
            if told
            else "None of these workers is connected.",
        )

    @admin.action(description="Rotate secret (disconnects the worker)")
    def rotate_secrets(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        for worker in queryset:
            _show_secret(request, worker, worker.rotate_secret(), "New secret")

    @admin.action(description="Revoke (refuse the secret, disconnect now)")
    def revoke_workers(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        revoked = Worker.objects.filter(pk__in=queryset.values("pk")).revoke()
        self.message_user(
            request,
            f"Revoked {len(revoked)} worker{'s' if len(revoked) != 1 else ''}: "
            + (", ".join(worker.name for worker in revoked) or "none was active"),
        )
