"""The admin site: Nexus's titles, "View site" to the dashboard, clear names."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

# (app label, model) -> how the admin's index and sidebar name it: the two
# kinds of credential are easy to mix up.
MODEL_NAMES = {
    ("authtoken", "tokenproxy"): "Admin tokens (for scripts)",
    ("usage", "apikey"): "Client API keys (for /v1)",
    ("routing", "configrevision"): "Configuration history",
}


class NexusAdminSite(admin.AdminSite):
    site_header = "Nexus administration"
    site_title = "Nexus"
    index_title = "Gateway configuration"
    site_url = "/dashboard/"
    # The sidebar of every app took a quarter of a 1280 px screen from lists;
    # the index and the breadcrumbs lead everywhere it did.
    enable_nav_sidebar = False

    def get_app_list(
        self, request: HttpRequest, app_label: str | None = None
    ) -> list[Any]:
        apps = super().get_app_list(request, app_label)
        for app in apps:
            for model in app["models"]:
                key = (app["app_label"], model["object_name"].lower())
                model["name"] = MODEL_NAMES.get(key, model["name"])
        return apps
