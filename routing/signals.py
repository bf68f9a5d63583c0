"""Mark the routing configuration changed whenever routing data is saved or deleted."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from backends.models import Backend, BackendModel
from routing.models import Alias, ChainStep, FallbackChain, RoutingPolicy
from routing.versioning import mark_config_changed

ROUTING_MODELS = (Backend, BackendModel, Alias, FallbackChain, ChainStep, RoutingPolicy)


@receiver(post_save)
@receiver(post_delete)
def routing_data_changed(sender: type, using: str, **kwargs: Any) -> None:
    if sender in ROUTING_MODELS:
        mark_config_changed(using)
