"""The routing configuration version: bumped on commit, broadcast to every process.

routing/signals.py calls ``mark_config_changed()`` when a routing, backend or
client-key row is saved or deleted, and when ``backends`` or ``usage`` announce
a bulk write (they never call up into routing); routing's own writers may call
it directly inside their transaction. Once the transaction commits, the
persisted version goes up by one (and the configuration history records the
change: routing/history/recording.py) and the new number is sent to the
``CONFIG_GROUP`` group on the Channels layer, where every serving process
listens. A lost message only delays a process until its next periodic version
check.

Changes a relay worker's connection causes (register, models_update, its
socket closing) can come as fast as a hostile worker cares to reconnect; the
consumer makes them inside ``config_changes_deferred()``, which records that
something changed instead of bumping, and bumps itself at most once per
interval (gateway/relay/churn.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypedDict

from channels.layers import get_channel_layer
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.models import F

from nexus_lib.layer import run_on_layer
from routing.history.recording import note_config_change
from routing.models import ConfigVersion

logger = logging.getLogger(__name__)

CONFIG_GROUP = "nexus.config"


class ConfigChangedEvent(TypedDict):
    """The message sent to CONFIG_GROUP after a committed change."""

    type: str  # always "config.changed"
    version: int


class DeferredChanges:
    """What ``config_changes_deferred()`` saw: whether a change committed."""

    def __init__(self) -> None:
        self.changed = False

    def note(self) -> None:
        self.changed = True


_deferring = threading.local()


@contextmanager
def config_changes_deferred() -> Iterator[DeferredChanges]:
    """Inside this block (this thread), a committed change does not bump the
    version: it sets ``changed`` on what the block yields, and the caller
    bumps (``bump_and_broadcast()``) when it sees fit."""
    deferred = DeferredChanges()
    outer = getattr(_deferring, "changes", None)
    _deferring.changes = deferred
    try:
        yield deferred
    finally:
        _deferring.changes = outer


def mark_config_changed(using: str = DEFAULT_DB_ALIAS) -> None:
    """Bump and broadcast the version when the current transaction commits.

    Several changes in one transaction cause one bump.
    """
    deferred: DeferredChanges | None = getattr(_deferring, "changes", None)
    if deferred is not None:
        transaction.on_commit(deferred.note, using=using)
        return
    note_config_change(using)  # the configuration history
    connection = connections[using]
    # Savepoint rollbacks discard their on-commit callbacks, so looking at the
    # pending list (rather than keeping a flag of our own) stays correct.
    if connection.in_atomic_block and any(
        entry[1] is _bump_and_broadcast for entry in connection.run_on_commit
    ):
        return
    transaction.on_commit(_bump_and_broadcast, using=using)


def bump_and_broadcast() -> int:
    """Bump the version now and tell every serving process; return it."""
    version = bump_config_version()
    broadcast_config_version(version)
    return version


def _bump_and_broadcast() -> None:
    bump_and_broadcast()


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
