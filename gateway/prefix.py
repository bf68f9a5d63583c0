"""Prefix-aware routing's live state: which backend computed which prompt.

One ``PrefixIndex`` per serving process (the ``Gateway`` holds it). Per
model, every backend has an LRU of the prompt block keys it was sent
(routing.core.prefix.chain_keys), bounded by its cache size: the backend's
``prefix_cache_tokens`` (4 characters a token) or the policy's
``cache_blocks``. A dict from key to the backends holding it finds, for a
prompt, how many leading blocks each backend holds in one walk over the
prompt's keys. Sessions map to the backend they used last, for
``session_ttl_seconds``.

Everything is in memory, bounded (cache sizes, MAX_SESSIONS) and touched
only by the event loop's thread, so no lock: the router reads it while
deciding, and the pipeline records each decision as it is made (so that the
next request of a burst already follows it, as the model server will hold
the prefix once it starts computing).
"""

from __future__ import annotations

import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from routing.core.prefix import PrefixRequest, chain_keys, prompt_text
from routing.core.prefix_policy import PrefixPolicy
from routing.core.types import BackendSpec

# Sessions remembered at most, per process; the least recently used go first.
MAX_SESSIONS = 100_000
# A session id longer than this is cut (it is a key, not data).
MAX_SESSION_CHARS = 256
# Characters a token, to turn a backend's prefix_cache_tokens into blocks.
CHARS_PER_TOKEN = 4


class _ModelIndex:
    """One model's blocks: who holds each key, and each backend's LRU."""

    __slots__ = ("holders", "lrus")

    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}
        # backend -> its keys, least recently used first
        self.lrus: dict[str, OrderedDict[int, None]] = {}


class PrefixIndex:
    """The prompt blocks each backend computed, and each session's backend."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._models: dict[str, _ModelIndex] = {}
        self._block_chars = 0
        # (model, session) -> (backend, clock() when it expires)
        self._sessions: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    # The router's view (routing.core.prefix.PrefixView) -------------------

    def matched_blocks(self, model: str, keys: Sequence[int]) -> Mapping[str, int]:
        """Backend name -> how many of `keys`, from the first, it holds."""
        index = self._models.get(model)
        if index is None or not keys:
            return {}
        holders = index.holders
        first = holders.get(keys[0])
        if not first:
            return {}
        alive = set(first)
        matched: dict[str, int] = {}
        for position in range(1, len(keys)):
            held = holders.get(keys[position])
            still = alive & held if held else set()
            for name in alive - still:
                matched[name] = position
            alive = still
            if not alive:
                return matched
        for name in alive:
            matched[name] = len(keys)
        return matched

    def session_backend(self, model: str, session: str) -> str | None:
        """The backend `session` used last, if within its time to live."""
        found = self._sessions.get((model, session))
        if found is None:
            return None
        backend, expires = found
        if expires <= self._clock():
            del self._sessions[(model, session)]
            return None
        return backend

    # The pipeline's side ----------------------------------------------------

    def request_for(
        self,
        canonical: Mapping[str, Any],
        original: Mapping[str, Any],
        headers: Sequence[tuple[bytes, bytes]],
        policy: PrefixPolicy,
    ) -> PrefixRequest:
        """The prompt keys and session of a request, to route it with."""
        if policy.block_chars != self._block_chars:
            # Keys of another block size never match: start afresh.
            self._models.clear()
            self._block_chars = policy.block_chars
        text = prompt_text(canonical)
        keys, blocks = chain_keys(text, policy.block_chars)
        session = find_session(policy.session_key_list, original, headers)
        # surrogatepass: JSON may carry a lone surrogate ("\ud800").
        anchor = zlib.crc32(text[: policy.block_chars].encode("utf-8", "surrogatepass"))
        return PrefixRequest(keys, blocks, session, self, anchor)

    def record(
        self,
        model: str,
        backend: BackendSpec,
        request: PrefixRequest,
        policy: PrefixPolicy,
    ) -> None:
        """Note that `backend` computes the request's prompt (and session)."""
        if request.session is not None:
            self._remember_session(
                model, request.session, backend.name, policy.session_ttl_seconds
            )
        keys = request.keys
        if not keys:
            return
        index = self._models.get(model)
        if index is None:
            index = self._models.setdefault(model, _ModelIndex())
        name = backend.name
        lru = index.lrus.get(name)
        if lru is None:
            lru = index.lrus.setdefault(name, OrderedDict())
        capacity = cache_blocks(backend, policy)
        holders = index.holders
        # The last block first: a cache evicts a prompt's tail before its
        # head (the head is what other prompts share), and so does the LRU.
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                holder = holders.get(key)
                if holder is None:
                    holders[key] = {name}
                else:
                    holder.add(name)
        while len(lru) > capacity:
            key, _ = lru.popitem(last=False)
            holder = holders.get(key)
            if holder is not None:
                holder.discard(name)
                if not holder:
                    del holders[key]

    def held_blocks(self, model: str, backend: str) -> int:
        """Blocks `backend` is thought to hold for `model`."""
        index = self._models.get(model)
        lru = index.lrus.get(backend) if index is not None else None
        return 0 if lru is None else len(lru)

    def clear(self) -> None:
        """Forget every block and session."""
        self._models.clear()
        self._sessions.clear()

    def _remember_session(
        self, model: str, session: str, backend: str, ttl: float
    ) -> None:
        sessions = self._sessions
        key = (model, session)
        sessions[key] = (backend, self._clock() + ttl)
        sessions.move_to_end(key)
        while len(sessions) > MAX_SESSIONS:
            sessions.popitem(last=False)


def cache_blocks(backend: BackendSpec, policy: PrefixPolicy) -> int:
    """Blocks `backend`'s prompt cache holds per model."""
    tokens = backend.prefix_cache_tokens
    if tokens is None:
        return policy.cache_blocks
    return max(tokens * CHARS_PER_TOKEN // policy.block_chars, 1)


def find_session(
    keys: Sequence[str],
    body: Mapping[str, Any],
    headers: Sequence[tuple[bytes, bytes]],
) -> str | None:
    """The first of `keys` the request sets: a header (``x-...``) or a body
    field (``metadata.user_id`` reads a nested one); None for none."""
    for key in keys:
        value: object = None
        if key.startswith("x-"):
            wanted = key.encode("latin-1")
            for name, raw in headers:
                if name == wanted:
                    value = raw.decode("latin-1")
                    break
        else:
            value = body
            for part in key.split("."):
                value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(value, str) and value:
            return value[:MAX_SESSION_CHARS]
    return None
