"""What the backends app announces to the apps above it.

Saving or deleting one ``Backend`` or ``BackendModel`` already sends Django's
``post_save``/``post_delete``. Bulk writes (``QuerySet.update()``,
``bulk_create()``, ``bulk_update()``) send nothing, so the code that makes them
sends ``backends_changed`` through ``BackendQuerySet.announce_change()`` and
its siblings. The routing app subscribes (routing/signals.py); backends never
calls up into it.
"""

from __future__ import annotations

from django.dispatch import Signal

# Sent with ``sender`` (the model class written to) and ``using`` (the database
# alias), inside the transaction that made the change.
backends_changed = Signal()
