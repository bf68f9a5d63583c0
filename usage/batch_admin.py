"""The admin of batch jobs and their files (read-only; cancel, delete)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html

from usage.batches import jobs
from usage.batches.report import lines_per_second, seconds_left
from usage.models import ApiKey, Batch, File

if TYPE_CHECKING:
    BatchAdminBase = admin.ModelAdmin[Batch]
    FileAdminBase = admin.ModelAdmin[File]
else:
    BatchAdminBase = FileAdminBase = admin.ModelAdmin


# Shown in the list and on each batch's page.
_SHOWN = ("id", "api", "owner", "endpoint", "status", "progress", "rate", "eta")


@admin.register(Batch)
class BatchAdmin(BatchAdminBase):
    list_display = (*_SHOWN, "tokens", "created_at")
    list_filter = ("status", "api", "endpoint")
    search_fields = ("id", "owner_prefix", "input_file_key")
    actions = ("cancel_batches",)
    readonly_fields = (
        *_SHOWN,
        "completion_window",
        "input_file_key",
        "output_file",
        "error_file",
        "total",
        "completed",
        "failed",
        "cancelled_lines",
        "expired_lines",
        "prompt_tokens",
        "completion_tokens",
        "metadata",
        "errors",
        "created_at",
        "in_progress_at",
        "expires_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
        "lease_owner",
        "lease_until",
    )
    fields = readonly_fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Batch]:
        self._names = dict(ApiKey.objects.values_list("prefix", "name"))
        return super().get_queryset(request)

    @admin.display(description="owner key", ordering="owner_prefix")
    def owner(self, batch: Batch) -> str:
        if not batch.owner_prefix:
            return "(no key)"
        name = getattr(self, "_names", {}).get(batch.owner_prefix, "")
        return f"{name} ({batch.owner_prefix}…)" if name else f"{batch.owner_prefix}…"

    @admin.display(description="progress")
    def progress(self, batch: Batch) -> str:
        share = 100 * batch.done / batch.total if batch.total else 0
        return format_html(
            '<progress max="100" value="{}"></progress> {} / {} ({} failed)',
            round(share),
            batch.done,
            batch.total,
            batch.failed,
        )

    @admin.display(description="lines/s")
    def rate(self, batch: Batch) -> str:
        rate = lines_per_second(batch, timezone.now())
        return "–" if rate is None else f"{rate:.2f}"

    @admin.display(description="ETA")
    def eta(self, batch: Batch) -> str:
        left = seconds_left(batch, timezone.now())
        if left is None:
            return "–"
        minutes, seconds = divmod(round(left), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {seconds:02d}s"

    @admin.display(description="tokens (in / out)")
    def tokens(self, batch: Batch) -> str:
        return f"{batch.prompt_tokens} / {batch.completion_tokens}"

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        """Batches are never edited here, but who may change them (the role
        rule: key-admin, admin) may cancel them."""
        return request.user.has_perm("usage.change_batch")

    @admin.action(description="Cancel selected batches", permissions=["cancel"])
    def cancel_batches(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        cancelled = 0
        for batch in queryset:
            if batch.is_active:
                jobs.cancel_batch(batch)
                cancelled += 1
        self.message_user(
            request,
            f"Asked {cancelled} batch(es) to stop: no new line starts, the lines "
            "running finish and stay in the output.",
            messages.SUCCESS,
        )


@admin.register(File)
class FileAdmin(FileAdminBase):
    list_display = (
        "id",
        "owner_prefix",
        "purpose",
        "filename",
        "bytes",
        "line_count",
        "created_at",
        "expires_at",
    )
    list_filter = ("purpose",)
    search_fields = ("id", "owner_prefix", "filename")
    readonly_fields = list_display + ("endpoint", "path")
    fields = readonly_fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def delete_model(self, request: HttpRequest, obj: File) -> None:
        jobs.delete_file(obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[File]) -> None:
        for file in queryset:
            jobs.delete_file(file)
