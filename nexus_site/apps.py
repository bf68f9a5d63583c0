from __future__ import annotations

from django.apps import AppConfig, apps
from django.db.models.signals import post_migrate

from nexus_lib import live_views
from nexus_site.staff_roles import sync_roles_after_migrate

# The admin's app config is in nexus_site/admin_config.py: importing it loads
# the admin, which a gateway-only process (NEXUS_ROLE=gateway) never does.


class NexusSiteConfig(AppConfig):
    """The project package as an app: home of the launcher's commands."""

    name = "nexus_site"
    verbose_name = "Nexus"
    default = True

    def ready(self) -> None:
        # DRF's tokens are admin tokens for the management API; its app must
        # stay "rest_framework.authtoken" in INSTALLED_APPS (its models check
        # for that name), so the admin's heading is renamed here.
        if apps.is_installed("rest_framework.authtoken"):
            apps.get_app_config("authtoken").verbose_name = "Management API"
        # The admin shows what this serving process learned (nexus_lib.live_views).
        live_views.provide_learned_context(_learned_context)
        live_views.provide_cold_load_pause(_cold_load_pause)
        # The role groups follow their rule after every migrate (new models).
        post_migrate.connect(
            sync_roles_after_migrate, dispatch_uid="nexus_site.staff_roles.sync"
        )


def _learned_context(
    backend: str, model: str, context_length: int | None
) -> tuple[int, int | None] | None:
    from gateway.process import current_gateway

    return current_gateway().context_limits.peek(backend, model, context_length)


def _cold_load_pause(backend: str) -> str:
    from gateway.process import current_gateway

    return current_gateway().fleet.cold_load_pause(backend)
