"""Mark the routing configuration changed whenever what the gateway serves changes.

Routing subscribes to the apps below it: Django's save and delete signals of
the models the snapshot reads, and the announcements ``backends`` and ``usage``
make for bulk writes, which send no model signals. The lower apps never call
up into routing.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Model
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from backends.models import Backend, BackendModel, Worker
from backends.signals import backends_changed
from routing.models import (
    Alias,
    ChainStep,
    FallbackChain,
    Hedging,
    RoutingPolicy,
    Shadow,
    SplitTarget,
    TrafficSplit,
)
from routing.versioning import mark_config_changed
from usage.models import ApiKey, ModelPrice, Team
from usage.signals import api_keys_changed

# Client keys (which are valid, their limits) and model prices are part of what
# the proxy reads, so their changes travel the same way as routing data.
GATEWAY_MODELS: tuple[type[Model], ...] = (
    Backend,
    BackendModel,
    Alias,
    FallbackChain,
    ChainStep,
    RoutingPolicy,
    TrafficSplit,
    SplitTarget,
    Shadow,
    Hedging,
    ApiKey,
    Team,  # its limits hold its keys
    ModelPrice,
    Worker,  # where a relay worker's socket is (GatewayState.relay_channels)
)
# Saving only these fields changes nothing a serving process reads (a
# worker's refused models are for the operator to see).
_BOOKKEEPING_FIELDS = frozenset({"last_used_at", "last_seen_at", "refused_models"})


def gateway_row_changed(sender: type[Model], using: str, **kwargs: Any) -> None:
    """Mark the config changed after a gateway row is saved or deleted."""
    update_fields = kwargs.get("update_fields")
    if update_fields and set(update_fields) <= _BOOKKEEPING_FIELDS:
        return
    mark_config_changed(using)


for _model in GATEWAY_MODELS:
    post_save.connect(gateway_row_changed, sender=_model)
    post_delete.connect(gateway_row_changed, sender=_model)


@receiver(backends_changed)
@receiver(api_keys_changed)
def lower_app_data_changed(sender: type[Model], using: str, **kwargs: Any) -> None:
    """Mark the config changed after a bulk write a lower app announced."""
    mark_config_changed(using)
