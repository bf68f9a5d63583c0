"""Builders for router-core tests: plain data in, a snapshot and a route out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from routing.core import (
    BackendSpec,
    LiveStats,
    ModelSpec,
    RequestRequirements,
    Route,
    Router,
    RouterSnapshot,
    make_policy,
)

# The builders' models say "no" to every capability they are not given (the
# core's own default is None, unknown); tests of unknown pass None explicitly.
NO_CAPABILITIES = {
    "supports_vision": False,
    "supports_tools": False,
    "supports_json_mode": False,
}


def model(name: str, **capabilities: Any) -> ModelSpec:
    return ModelSpec(name=name, **(NO_CAPABILITIES | capabilities))


def backend(name: str, *models: str | ModelSpec, **fields: Any) -> BackendSpec:
    fields.setdefault("status", "healthy")
    return BackendSpec(
        name=name,
        base_url=f"http://{name}.lan:11434",
        models=tuple(m if isinstance(m, ModelSpec) else model(m) for m in models),
        **fields,
    )


def snapshot(
    *backends: BackendSpec,
    aliases: Mapping[str, str] | None = None,
    fallbacks: Mapping[str, list[str]] | None = None,
    strategy: str = "smart",
    max_retries: int = 2,
    version: int = 1,
) -> RouterSnapshot:
    return RouterSnapshot.build(
        version=version,
        backends=backends,
        aliases=aliases,
        fallbacks=fallbacks,
        policy=make_policy(strategy=strategy, max_retries=max_retries),
    )


def select(
    snap: RouterSnapshot,
    model_name: str,
    *,
    stats: LiveStats | None = None,
    router: Router | None = None,
    **needs: Any,
) -> Route:
    requirements = RequestRequirements(model=model_name, **needs)
    return (router or Router()).select(requirements, snap, stats or LiveStats())
