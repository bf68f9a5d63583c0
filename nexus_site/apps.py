from __future__ import annotations

from django.apps import AppConfig


class NexusSiteConfig(AppConfig):
    """The project package as an app: home of the launcher's commands."""

    name = "nexus_site"
    verbose_name = "Nexus"
