"""What the usage app announces to the apps above it.

Saving or deleting one ``ApiKey`` already sends Django's model signals; a bulk
``update()`` (deactivating keys) sends ``api_keys_changed`` instead. The routing
app subscribes (routing/signals.py), because which keys are valid is part of
what the gateway serves; usage never calls up into it.
"""

from __future__ import annotations

from django.dispatch import Signal

# Sent with ``sender`` (ApiKey) and ``using`` (the database alias), inside the
# transaction that made the change.
api_keys_changed = Signal()
