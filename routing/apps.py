from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class RoutingConfig(AppConfig):
    name = "routing"
    verbose_name = "Routing"

    def ready(self) -> None:
        from routing import signals  # noqa: F401  (connects the receivers)

        post_migrate.connect(_start_history, sender=self)


def _start_history(using: str, **kwargs: Any) -> None:
    # Imported here: apps.py is loaded before the models exist.
    from routing.history.recording import record_first_version

    record_first_version(using)
