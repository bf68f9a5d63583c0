from __future__ import annotations

from django.apps import AppConfig


class RoutingConfig(AppConfig):
    name = "routing"
    verbose_name = "Routing"

    def ready(self) -> None:
        from routing import signals  # noqa: F401  (connects the receivers)
