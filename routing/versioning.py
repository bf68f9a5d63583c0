"""The routing configuration version: bumped on commit, broadcast to every process.

routing/signals.py calls ``mark_config_changed()`` when a routing, backend or
client-key row is saved or deleted, and when ``backends`` or ``usage`` announce
a bulk write (they never call up into routing); routing's own writers may call
it directly inside their transaction. Once the transaction commits, the
persisted version goes up by one and the new number is sent to the
``CONFIG_GROUP`` group on the Channels layer, where every serving process
listens. A lost message only delays a process until its next periodic version
check.
"""

from __future__ import annotations

import logging
from typing import TypedDict

from channels.layers import get_channel_layer
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.models import F

from nexus_lib.layer import run_on_layer
from routing.models import ConfigVersion

logger = logging.getLogger(__name__)

CONFIG_GROUP = "nexus.config"


class ConfigChangedEvent(TypedDict):
    """The message sent to CONFIG_GROUP after a committed change."""

    type: str  # always "config.changed"
    version: int


def mark_config_changed(using: str = DEFAULT_DB_ALIAS) -> None:
    """Bump and broadcast the version when the current transaction commits.

    Several changes in one transaction cause one bump.
    """
    connection = connections[using]
    # Savepoint rollbacks discard their on-commit callbacks, so looking at the
    # pending list (rather than keeping a flag of our own) stays correct.
    if connection.in_atomic_block and any(
        entry[1] is _bump_and_broadcast for entry in connection.run_on_commit
    ):
        return
    transaction.on_commit(_bump_and_broadcast, using=using)


def _bump_and_broadcast() -> None:
    broadcast_config_version(bump_config_version())


def bump_config_version() -> int:
    """Add one to the persisted version and return the new value."""
    with transaction.atomic():
        updated = ConfigVersion.objects.filter(pk=ConfigVersion.SINGLETON_PK).update(
            version=F("version") + 1
        )
        if not updated:
            ConfigVersion.objects.get_or_create(
                pk=ConfigVersion.SINGLETON_PK, defaults={"version": 1}
            )
        return read_config_version()


def read_config_version() -> int:
    """Return the persisted version (0 before the first change)."""
    version = (
        ConfigVersion.objects.filter(pk=ConfigVersion.SINGLETON_PK)
        .values_list("version", flat=True)
        .first()
    )
    return version or 0


def broadcast_config_version(version: int) -> None:
    """Tell every serving process about a new version; never raises."""
    layer = get_channel_layer()
    if layer is None:
        return
    event: ConfigChangedEvent = {"type": "config.changed", "version": version}
    try:
        run_on_layer(lambda: layer.group_send(CONFIG_GROUP, event))
    except Exception:
        # The periodic version check in every process repairs a lost broadcast.
        logger.warning("Could not broadcast config version %s", version, exc_info=True)
