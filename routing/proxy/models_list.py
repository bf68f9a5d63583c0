"""``GET /v1/models``: what this gateway serves, in OpenAI's list format.

A key with an allow-list sees only the models and aliases it may use; each
key's list is serialised once per snapshot.
"""

from __future__ import annotations

import json
import time
from typing import Any

from routing.core import RouterSnapshot
from usage.limits.policy import KeyPolicy


class ModelsList:
    """The model list of one snapshot, serialised once and reused."""

    def __init__(self) -> None:
        self._snapshot: RouterSnapshot | None = None
        self._entries: dict[str, dict[str, Any]] = {}
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
                if _is_allowed(policy, snapshot, name)
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
        self._refresh(snapshot)
        entry = self._entries.get(model_id)
        if entry is None or (
            policy is not None and not _is_allowed(policy, snapshot, model_id)
        ):
            return None
        return json.dumps(entry).encode()

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
        # Aliases whose target is listed (one nobody serves would only 404 or
        # 503); owned_by says what it is.
        for alias, target in sorted(snapshot.aliases.items()):
            if alias not in entries and target in entries:
                entries[alias] = {
                    "id": alias,
                    "object": "model",
                    "created": created,
                    "owned_by": f"alias:{target}",
                }
        self._entries = entries
        self._body = json.dumps(
            {"object": "list", "data": list(entries.values())}
        ).encode()
        self._bodies = {}
        self._snapshot = snapshot


def _is_allowed(policy: KeyPolicy, snapshot: RouterSnapshot, name: str) -> bool:
    target = snapshot.aliases.get(name)
    return policy.allows(name) if target is None else policy.allows(name, target)
