"""``GET /v1/models``: what this gateway serves, in OpenAI's list format, or
in Anthropic's (Models API) for Anthropic clients.

A key with an allow-list sees only the models and aliases it may use; each
key's OpenAI list is serialised once per snapshot. Multiple-opinions names
(``moe-<model>``, gateway/proxy/ensemble/) are listed for every model two
healthy backends or more serve, for keys allowed both names.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

from gateway.proxy.ensemble.plans import listed_ensembles
from gateway.proxy.errors import ProxyError
from routing.core import RouterSnapshot
from usage.limits.policy import KeyPolicy

# Anthropic's Models API pages: `limit` 1..1000, 20 when not given.
ANTHROPIC_DEFAULT_LIMIT = 20
ANTHROPIC_MAX_LIMIT = 1000


class ModelsList:
    """The model list of one snapshot, serialised once and reused."""

    def __init__(self) -> None:
        self._snapshot: RouterSnapshot | None = None
        self._entries: dict[str, dict[str, Any]] = {}
        # Listed moe- names -> their base model (allowed both, or not listed).
        self._bases: dict[str, str] = {}
        self._body = b""
        # Key prefix -> its filtered list, for keys with an allow-list.
        self._bodies: dict[str, bytes] = {}

    def body(self, snapshot: RouterSnapshot, policy: KeyPolicy | None = None) -> bytes:
        self._refresh(snapshot)
        if policy is None or not policy.allowed_models:
            return self._body
        body = self._bodies.get(policy.prefix)
        if body is None:
            data = [
                entry
                for name, entry in self._entries.items()
                if self._allows(policy, snapshot, name)
            ]
            body = json.dumps({"object": "list", "data": data}).encode()
            if len(self._bodies) < 10_000:
                self._bodies[policy.prefix] = body
        return body

    def entry(
        self,
        snapshot: RouterSnapshot,
        model_id: str,
        policy: KeyPolicy | None = None,
    ) -> bytes | None:
        if not self._visible(snapshot, model_id, policy):
            return None
        return json.dumps(self._entries[model_id]).encode()

    def anthropic_page(
        self,
        snapshot: RouterSnapshot,
        policy: KeyPolicy | None,
        query_string: bytes,
    ) -> bytes:
        """Anthropic's model list: ids in order, paged by `limit` and the
        `after_id` / `before_id` cursors (ids need not be listed still)."""
        self._refresh(snapshot)
        limit, after_id, before_id = _anthropic_params(query_string)
        ids = sorted(
            name
            for name in self._entries
            if policy is None
            or not policy.allowed_models
            or self._allows(policy, snapshot, name)
        )
        if before_id is not None:
            ids = [name for name in ids if name < before_id]
            page, has_more = ids[-limit:], len(ids) > limit
        else:
            if after_id is not None:
                ids = [name for name in ids if name > after_id]
            page, has_more = ids[:limit], len(ids) > limit
        return json.dumps(
            {
                "data": [self._anthropic_entry(name) for name in page],
                "has_more": has_more,
                "first_id": page[0] if page else None,
                "last_id": page[-1] if page else None,
            }
        ).encode()

    def anthropic_entry(
        self,
        snapshot: RouterSnapshot,
        model_id: str,
        policy: KeyPolicy | None = None,
    ) -> bytes | None:
        if not self._visible(snapshot, model_id, policy):
            return None
        return json.dumps(self._anthropic_entry(model_id)).encode()

    def _visible(
        self, snapshot: RouterSnapshot, model_id: str, policy: KeyPolicy | None
    ) -> bool:
        """Listed in this snapshot, and the key may use it."""
        self._refresh(snapshot)
        return model_id in self._entries and (
            policy is None or self._allows(policy, snapshot, model_id)
        )

    def _allows(self, policy: KeyPolicy, snapshot: RouterSnapshot, name: str) -> bool:
        base = self._bases.get(name)
        return _is_allowed(policy, snapshot, name) and (
            base is None or _is_allowed(policy, snapshot, base)
        )

    def _anthropic_entry(self, name: str) -> dict[str, Any]:
        created = datetime.fromtimestamp(self._entries[name]["created"], UTC)
        return {
            "type": "model",
            "id": name,
            "display_name": name,
            "created_at": created.isoformat().replace("+00:00", "Z"),
        }

    def _refresh(self, snapshot: RouterSnapshot) -> None:
        if snapshot is self._snapshot:
            return
        created = int(time.time())
        entries: dict[str, dict[str, Any]] = {}
        # Models with at least one healthy, enabled backend; owned_by names them.
        for name, routes in sorted(snapshot.routes.items()):
            if routes.backend_names:
                entries[name] = {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": ",".join(routes.backend_names),
                }
        # Aliases that route: their target is listed, or a model of their
        # fallback chain is (one that leads nowhere would only 404 or 503);
        # owned_by says what it is. Pattern aliases (claude-*) are no model
        # and not listed: the names they cover answer when asked for.
        for alias, target in sorted(snapshot.aliases.items()):
            if alias not in entries and any(
                name in entries for name in snapshot.models_for(alias)[1:]
            ):
                entries[alias] = {
                    "id": alias,
                    "object": "model",
                    "created": created,
                    "owned_by": f"alias:{target}",
                }
        # Splits of which some side routes; owned_by names the sides.
        for name, split in sorted(snapshot.splits.items()):
            if name not in entries and any(
                model in entries for model in snapshot.models_for(name)
            ):
                entries[name] = {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "split:" + ",".join(s.model for s in split.sides),
                }
        # Ensembles of the models listed above (ensemble.listed_ensembles).
        bases = {
            moe: base
            for moe, base in sorted(listed_ensembles(snapshot).items())
            if moe not in entries
        }
        for moe, base in bases.items():
            entries[moe] = {
                "id": moe,
                "object": "model",
                "created": created,
                "owned_by": f"ensemble:{base}",
            }
        self._bases = bases
        self._entries = entries
        self._body = json.dumps(
            {"object": "list", "data": list(entries.values())}
        ).encode()
        self._bodies = {}
        self._snapshot = snapshot


def _is_allowed(policy: KeyPolicy, snapshot: RouterSnapshot, name: str) -> bool:
    target = snapshot.alias_for(name)
    return policy.allows(name) if target is None else policy.allows(name, target)


def _anthropic_params(query_string: bytes) -> tuple[int, str | None, str | None]:
    """`limit`, `after_id` and `before_id` of an Anthropic model list request."""
    try:
        params = parse_qs(query_string.decode(), strict_parsing=False)
    except UnicodeDecodeError:
        raise ProxyError(400, "The query string is not valid UTF-8.") from None
    limit = ANTHROPIC_DEFAULT_LIMIT
    if "limit" in params:
        raw = params["limit"][-1]
        # ASCII digits only: int() takes "²" and other Unicode digits badly.
        if not (
            raw.isascii()
            and raw.isdigit()
            and len(raw) <= 4
            and 1 <= int(raw) <= ANTHROPIC_MAX_LIMIT
        ):
            raise ProxyError(
                400,
                f"limit: must be an integer from 1 to {ANTHROPIC_MAX_LIMIT}, "
                f"not {raw[:40]!r}.",
                param="limit",
            )
        limit = int(raw)
    after_id = params.get("after_id", [None])[-1]
    before_id = params.get("before_id", [None])[-1]
    if after_id is not None and before_id is not None:
        raise ProxyError(400, "Send after_id or before_id, not both.")
    return limit, after_id, before_id
