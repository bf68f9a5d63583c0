"""Ollama's model endpoints for the whole fleet: ``/api/tags``, ``/api/ps``, ``/api/show``.

Answered from the router snapshot, like ``GET /v1/models``, never by asking
backends: ``/api/tags`` lists every model a healthy backend serves plus every
alias; ``/api/ps`` the models that are ready to answer without loading (those
an Ollama backend reported loaded, and every model of the other kinds, which
keep theirs loaded); ``/api/show`` a model's context length (the smallest over
its healthy backends) and capabilities (``tools`` / ``vision`` when any of them
has it). Multiple-opinions names (``moe-<model>``) are listed and shown as
in ``/v1/models`` (gateway/proxy/models_list.py), without ``tools`` (an
ensemble answers in text). Bodies are built once per snapshot.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from gateway.proxy.ensemble.plans import listed_ensembles
from gateway.proxy.limits import is_model_allowed
from routing.core import RouterSnapshot
from routing.core.types import ModelRoutes
from usage.limits.policy import KeyPolicy

OLLAMA_KIND = "ollama"
# What a model's details say when Nexus does not know (it has no weights).
_DETAILS = {
    "parent_model": "",
    "format": "",
    "family": "nexus",
    "families": ["nexus"],
    "parameter_size": "",
    "quantization_level": "",
}


class OllamaCatalog:
    """The model catalogue of one snapshot in Ollama's shapes, cached."""

    def __init__(self) -> None:
        self._snapshot: RouterSnapshot | None = None
        self._tags = b""
        self._ps = b""
        self._show: dict[str, bytes] = {}
        self._entries: dict[str, dict[str, Any]] = {}
        self._running: list[dict[str, Any]] = []
        # Listed moe- names -> their base model (allowed both, or not listed).
        self._bases: dict[str, str] = {}
        # Key prefix -> (tags, ps) filtered by its allow-list, once per snapshot.
        self._filtered: dict[str, tuple[bytes, bytes]] = {}

    def tags(self, snapshot: RouterSnapshot, policy: KeyPolicy | None = None) -> bytes:
        self._refresh(snapshot)
        if policy is None or not policy.allowed_models:
            return self._tags
        return self._for_key(snapshot, policy)[0]

    def ps(self, snapshot: RouterSnapshot, policy: KeyPolicy | None = None) -> bytes:
        self._refresh(snapshot)
        if policy is None or not policy.allowed_models:
            return self._ps
        return self._for_key(snapshot, policy)[1]

    def show(
        self, snapshot: RouterSnapshot, model: str, policy: KeyPolicy | None = None
    ) -> bytes | None:
        """The ``/api/show`` body of a model or alias, None when unknown (or
        outside the key's allow-list: a key learns nothing beyond it)."""
        self._refresh(snapshot)
        if policy is not None and not self._allows(policy, snapshot, model):
            return None
        return self._show.get(model)

    def _allows(self, policy: KeyPolicy, snapshot: RouterSnapshot, name: str) -> bool:
        base = self._bases.get(name)
        return is_model_allowed(policy, snapshot, name) and (
            base is None or is_model_allowed(policy, snapshot, base)
        )

    def _for_key(
        self, snapshot: RouterSnapshot, policy: KeyPolicy
    ) -> tuple[bytes, bytes]:
        bodies = self._filtered.get(policy.prefix)
        if bodies is None:
            tags = [
                entry
                for name, entry in self._entries.items()
                if self._allows(policy, snapshot, name)
            ]
            running = [
                entry
                for entry in self._running
                if is_model_allowed(policy, snapshot, entry["name"])
            ]
            bodies = (
                json.dumps({"models": tags}).encode(),
                json.dumps({"models": running}).encode(),
            )
            if len(self._filtered) < 10_000:
                self._filtered[policy.prefix] = bodies
        return bodies

    def _refresh(self, snapshot: RouterSnapshot) -> None:
        if snapshot is self._snapshot:
            return
        now = time.time()
        modified = _iso(now)
        served = {
            name: routes
            for name, routes in sorted(snapshot.routes.items())
            if routes.backend_names
        }
        entries = {name: _tag(name, modified) for name in served}
        shows = {name: _show(routes, modified) for name, routes in served.items()}
        for alias, target in sorted(snapshot.aliases.items()):
            if alias not in entries:
                entries[alias] = _tag(alias, modified)
                routes = snapshot.routes.get(target)
                if routes is not None and routes.backend_names:
                    shows[alias] = _show(routes, modified)
        bases = {
            moe: base
            for moe, base in sorted(listed_ensembles(snapshot).items())
            if moe not in entries
        }
        for moe, base in bases.items():
            entries[moe] = _tag(moe, modified)
            shown = _show(served[base], modified)
            shown["capabilities"] = [c for c in shown["capabilities"] if c != "tools"]
            shows[moe] = shown
        expires = _iso(now + 24 * 3600)
        running = [
            {
                **entries[name],
                "expires_at": expires,
                "size_vram": 0,
                "context_length": _context_length(routes),
            }
            for name, routes in served.items()
            if _is_running(routes)
        ]
        self._tags = json.dumps({"models": list(entries.values())}).encode()
        self._ps = json.dumps({"models": running}).encode()
        self._show = {name: json.dumps(body).encode() for name, body in shows.items()}
        self._entries = entries
        self._bases = bases
        self._running = running
        self._filtered = {}
        self._snapshot = snapshot


def _tag(name: str, modified: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": name,
        "modified_at": modified,
        "size": 0,
        "digest": hashlib.sha256(name.encode()).hexdigest(),
        "details": _DETAILS,
    }


def _show(routes: ModelRoutes, modified: str) -> dict[str, Any]:
    capabilities = ["completion"]
    prepared = [p.target.model for p in routes.routable]
    if any(m.supports_vision for m in prepared):
        capabilities.append("vision")
    if any(m.supports_tools for m in prepared):
        capabilities.append("tools")
    info: dict[str, Any] = {"general.architecture": "nexus"}
    context = _context_length(routes)
    if context:
        info["nexus.context_length"] = context
    return {
        "license": "",
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": _DETAILS,
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": modified,
    }


def _context_length(routes: ModelRoutes) -> int:
    known = [
        p.target.model.context_length
        for p in routes.routable
        if p.target.model.context_length
    ]
    return min(known) if known else 0


def _is_running(routes: ModelRoutes) -> bool:
    return any(
        p.target.backend.kind != OLLAMA_KIND or p.target.model.loaded
        for p in routes.routable
    )


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
