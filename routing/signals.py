"""Mark the routing configuration changed whenever routing data is saved or deleted."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from backends.models import Backend, BackendModel
from routing.models import Alias, ChainStep, FallbackChain, RoutingPolicy
from routing.versioning import mark_config_changed
from usage.models import ApiKey

# Client keys are part of what the proxy reads (which keys are valid), so their
# changes travel the same way as routing data.
GATEWAY_MODELS = (
    Backend,
    BackendModel,
    Alias,
    FallbackChain,
    ChainStep,
    RoutingPolicy,
    ApiKey,
)
# Saving only these fields changes nothing a serving process reads.
_BOOKKEEPING_FIELDS = frozenset({"last_used_at"})


@receiver(post_save)
@receiver(post_delete)
def gateway_data_changed(sender: type, using: str, **kwargs: Any) -> None:
    if sender not in GATEWAY_MODELS:
        return
    update_fields = kwargs.get("update_fields")
    if update_fields and set(update_fields) <= _BOOKKEEPING_FIELDS:
        return
    mark_config_changed(using)
