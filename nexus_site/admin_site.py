"""The admin site: Nexus's titles, "View site" to the dashboard, clear names."""

from __future__ import annotations

from typing import Any

from django.conf import settings
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

    def login(self, request: HttpRequest, extra_context: Any = None) -> Any:
        """The login page, with the "Sign in with ..." button when SSO is on."""
        failures = {
            "failed": "Single sign-on did not sign you in: your account may "
            "have no role in Nexus. Ask an administrator.",
            "unavailable": "The single sign-on provider cannot be reached; "
            "try again shortly.",
        }
        context = {
            "sso_enabled": settings.NEXUS_OIDC_ENABLED,
            "sso_name": settings.NEXUS_OIDC_PROVIDER_NAME,
            "local_login": settings.NEXUS_LOCAL_LOGIN,
            "sso_problem": failures.get(request.GET.get("sso", "")),
            **(extra_context or {}),
        }
        return super().login(request, context)

    def register(
        self, model_or_iterable: Any, admin_class: Any = None, **options: Any
    ) -> None:
        super().register(model_or_iterable, admin_class, **options)
        if admin_class is not None:
            _deny_actions_by_default(admin_class)

    def get_app_list(
        self, request: HttpRequest, app_label: str | None = None
    ) -> list[Any]:
        apps = super().get_app_list(request, app_label)
        for app in apps:
            for model in app["models"]:
                key = (app["app_label"], model["object_name"].lower())
                model["name"] = MODEL_NAMES.get(key, model["name"])
        return apps


def _deny_actions_by_default(admin_class: Any) -> None:
    """An admin action that names no permission needs the change permission.

    Django offers such an action to everyone who may view the list: a viewer
    could run "Drain" or "Check health now". Default deny, as for the API.
    """
    for name in admin_class.actions or ():
        action = getattr(admin_class, name, None) if isinstance(name, str) else name
        if action is not None and not hasattr(action, "allowed_permissions"):
            action.allowed_permissions = ("change",)
