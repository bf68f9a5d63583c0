"""``GET /v1/models``: what this gateway serves, in OpenAI's list format."""

from __future__ import annotations

import json
import time
from typing import Any

from routing.core import RouterSnapshot


class ModelsList:
    """The model list of one snapshot, serialised once and reused."""

    def __init__(self) -> None:
        self._snapshot: RouterSnapshot | None = None
        self._entries: dict[str, dict[str, Any]] = {}
        self._body = b""

    def body(self, snapshot: RouterSnapshot) -> bytes:
        self._refresh(snapshot)
        return self._body

    def entry(self, snapshot: RouterSnapshot, model_id: str) -> bytes | None:
        self._refresh(snapshot)
        entry = self._entries.get(model_id)
        return None if entry is None else json.dumps(entry).encode()

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
        self._snapshot = snapshot
