"""The admin's "Configuration history": versions, their differences, revert.

The list shows each version's author and the first of its changes; a
version's page shows every change as a table and the configuration as it was;
"Revert to this version" (a button there, or the list's action on one
selected version) previews what would change, and applies it on
confirmation, as a new version.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join

from routing.config_file import ConfigError
from routing.history.diff import (
    ADDED,
    REMOVED,
    Change,
    format_path,
    summarize_version,
)
from routing.history.revert import VersionNotFound, revert_to
from routing.models import ConfigRevision

if TYPE_CHECKING:
    ConfigRevisionAdminBase = admin.ModelAdmin[ConfigRevision]
else:
    ConfigRevisionAdminBase = admin.ModelAdmin

REVERT_PERMISSION = "routing.revert_configrevision"


@admin.register(ConfigRevision)
class ConfigRevisionAdmin(ConfigRevisionAdminBase):
    list_display = ("version", "created", "author", "via", "changes")
    list_filter = ("via",)
    search_fields = ("author",)
    actions = ("revert_to_selected",)
    fields = (
        "number",
        "created_at",
        "author",
        "via",
        "reverted_to",
        "diff_table",
        "revert_button",
        "toml",
    )
    readonly_fields = fields
    list_per_page = 50

    def get_queryset(self, request: HttpRequest) -> QuerySet[ConfigRevision]:
        return super().get_queryset(request).defer("snapshot", "secret_marks")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: ConfigRevision | None = None
    ) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: ConfigRevision | None = None
    ) -> bool:
        return False

    def get_fields(
        self, request: HttpRequest, obj: ConfigRevision | None = None
    ) -> Any:
        fields = super().get_fields(request, obj)
        if self.has_revert_permission(request):
            return fields
        return [field for field in fields if field != "revert_button"]

    def has_revert_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(REVERT_PERMISSION)

    @admin.display(description="version", ordering="number")
    def version(self, obj: ConfigRevision) -> str:
        return str(obj.number)

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: ConfigRevision) -> datetime:
        return obj.created_at

    @admin.display(description="changes")
    def changes(self, obj: ConfigRevision) -> str:
        return summarize_version(obj.diff, obj.reverted_to)

    @admin.display(description="changes")
    def diff_table(self, obj: ConfigRevision) -> str:
        return render_changes(obj.diff)

    @admin.display(description="configuration (TOML export)")
    def toml(self, obj: ConfigRevision) -> str:
        return format_html("<pre>{}</pre>", obj.snapshot)

    @admin.display(description="revert")
    def revert_button(self, obj: ConfigRevision) -> str:
        url = reverse(
            f"{self.admin_site.name}:routing_configrevision_revert", args=(obj.number,)
        )
        return format_html(
            '<a class="button" href="{}">Revert to this version</a>', url
        )

    @admin.action(description="Revert to this version", permissions=("revert",))
    def revert_to_selected(
        self, request: HttpRequest, queryset: QuerySet[ConfigRevision]
    ) -> HttpResponse | None:
        numbers = list(queryset.values_list("number", flat=True)[:2])
        if len(numbers) != 1:
            self.message_user(
                request, "Select exactly one version to revert to.", messages.WARNING
            )
            return None
        return HttpResponseRedirect(
            reverse(
                f"{self.admin_site.name}:routing_configrevision_revert",
                args=(numbers[0],),
            )
        )

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.revert_view)
        own = [path("<int:number>/revert/", view, name="routing_configrevision_revert")]
        return own + super().get_urls()

    def revert_view(self, request: HttpRequest, number: int) -> HttpResponse:
        """Preview a revert (GET) and apply it (POST)."""
        if not self.has_revert_permission(request):
            raise PermissionDenied
        apply = request.method == "POST"
        try:
            result = revert_to(number, dry_run=not apply)
        except VersionNotFound as error:
            raise Http404(str(error)) from None
        except ConfigError as error:
            self.message_user(
                request,
                format_html(
                    "Version {} cannot be applied now; nothing was changed:<ul>{}</ul>",
                    number,
                    format_html_join("", "<li>{}</li>", ((p,) for p in error.problems)),
                ),
                messages.ERROR,
            )
            return HttpResponseRedirect(self._version_url(number))
        if apply:
            for warning in result.warnings:
                self.message_user(request, warning, messages.WARNING)
            if result.version is None:
                text = f"The configuration already matches version {number}."
                self.message_user(request, text, messages.INFO)
            else:
                self.message_user(
                    request,
                    f"Reverted to version {number}, recorded as version "
                    f"{result.version}.",
                    messages.SUCCESS,
                )
            return HttpResponseRedirect(
                reverse(f"{self.admin_site.name}:routing_configrevision_changelist")
            )
        context = {
            **self.admin_site.each_context(request),
            "title": f"Revert to version {number}?",
            "opts": self.model._meta,
            "number": number,
            "version_url": self._version_url(number),
            "changes": render_changes(result.changes),
            "has_changes": bool(result.changes),
            "warnings": result.warnings,
        }
        return TemplateResponse(
            request, "admin/routing/configrevision/revert.html", context
        )

    def _version_url(self, number: int) -> str:
        revision = ConfigRevision.objects.filter(number=number).only("pk").first()
        if revision is None:
            return reverse(f"{self.admin_site.name}:routing_configrevision_changelist")
        return reverse(
            f"{self.admin_site.name}:routing_configrevision_change",
            args=(revision.pk,),
        )


def render_changes(changes: list[Change]) -> str:
    """The changes as an HTML table: setting, change, before, after."""
    if not changes:
        return format_html("<p>{}</p>", "No change.")
    rows = format_html_join(
        "",
        "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>",
        (
            (
                format_path(change["path"]),
                change["change"],
                _shown(change, "before"),
                _shown(change, "after"),
            )
            for change in changes
        ),
    )
    return format_html(
        '<table class="config-diff"><thead><tr><th>setting</th><th>change</th>'
        "<th>before</th><th>after</th></tr></thead><tbody>{}</tbody></table>",
        rows,
    )


def _shown(change: Change, side: str) -> str:
    if change.get("secret"):
        return format_html("<em>{}</em>", "secret, never kept")
    missing = (side == "before" and change["change"] == ADDED) or (
        side == "after" and change["change"] == REMOVED
    )
    if missing:
        return ""
    value: Any = change.get(side)
    if isinstance(value, dict | list):
        return format_html(
            "<pre>{}</pre>", json.dumps(value, indent=2, ensure_ascii=False)
        )
    return format_html("<code>{}</code>", json.dumps(value, ensure_ascii=False))
