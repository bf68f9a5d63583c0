"""``[cache]``: the exact response cache (gateway/cache/).

Off by default. When on, a request whose canonical form, served model and
scope match a stored answer is answered from the cache for ``ttl_seconds``
after it was stored; ``scope`` "key" keeps each client key's answers to
itself, "shared" lets every key use every answer. Answers over
``max_entry_bytes`` are not stored. With ``only_deterministic`` only
requests with temperature 0, a ``seed``, or the opt-in header
``x-nexus-cache: on`` are cached (see docs/caching.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

SCOPE_KEY = "key"
SCOPE_SHARED = "shared"
SCOPES = (SCOPE_KEY, SCOPE_SHARED)
TTL_LIMIT = 30 * 24 * 3600  # a month
ENTRY_BYTES_LIMIT = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """Whether answers are cached, for how long, for whom, and which."""

    enabled: bool = False
    ttl_seconds: int = 3600
    scope: str = SCOPE_KEY
    max_entry_bytes: int = 1024 * 1024
    only_deterministic: bool = True
    # Purges: an entry stored before the time that covers it is not served.
    purged_all: float = 0.0
    purged_models: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({})
    )
    purged_keys: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def __post_init__(self) -> None:
        if not 1 <= self.ttl_seconds <= TTL_LIMIT:
            raise ValueError(
                f"cache ttl_seconds must be within 1..{TTL_LIMIT}, "
                f"got {self.ttl_seconds}"
            )
        if self.scope not in SCOPES:
            raise ValueError(
                f"cache scope must be 'key' or 'shared', not {self.scope!r}"
            )
        if not 1 <= self.max_entry_bytes <= ENTRY_BYTES_LIMIT:
            raise ValueError(
                f"cache max_entry_bytes must be within 1..{ENTRY_BYTES_LIMIT}, "
                f"got {self.max_entry_bytes}"
            )

    def is_purged(self, stored_at: float, model: str, key_prefix: str) -> bool:
        """Whether an entry of `model` (stored for `key_prefix`, "" shared)
        at `stored_at` was purged since."""
        if stored_at <= self.purged_all:
            return True
        models, keys = self.purged_models, self.purged_keys
        if models and stored_at <= models.get(model, 0.0):
            return True
        return bool(keys) and stored_at <= keys.get(key_prefix, 0.0)


def purge_times(record: object) -> dict[str, Any]:
    """The purge times a stored purge record holds, as CachePolicy's fields
    (whatever is not a time is left out)."""
    if not isinstance(record, dict):
        return {}
    times: dict[str, Any] = {}
    every = record.get("all")
    if isinstance(every, int | float):
        times["purged_all"] = float(every)
    for name, field_name in (("models", "purged_models"), ("keys", "purged_keys")):
        found = record.get(name)
        if isinstance(found, dict):
            times[field_name] = MappingProxyType(
                {
                    str(key): float(when)
                    for key, when in found.items()
                    if isinstance(when, int | float)
                }
            )
    return times
