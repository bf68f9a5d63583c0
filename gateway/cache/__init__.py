"""The exact response cache: a repeated request answered without a backend.

``keys`` makes a request's cache key, ``entries`` what is stored and how a
stream is put together and replayed, ``stores`` where entries live (memory
or Redis), ``service`` the process's ``ResponseCache``. The proxy's side
(what is cacheable, answering a hit, keeping a miss) is
gateway/proxy/cached.py; the settings are ``[cache]``
(routing.core.cache_policy). See docs/caching.md.
"""

from gateway.cache.entries import Entry, ReplyCollector, replay_chunks
from gateway.cache.service import ResponseCache, entry_key, scope_of

__all__ = [
    "Entry",
    "ReplyCollector",
    "ResponseCache",
    "entry_key",
    "replay_chunks",
    "scope_of",
]
