"""Purging the response cache, and what it has served (admin, API, command).

A purge is recorded in the routing policy (``cache_purges``): the time of
the last purge of everything, of each model and of each client key. Saving
it bumps the configuration version, so every serving process stops serving
the entries it covers as soon as it routes with the new configuration
(``routing.core.cache_policy.CachePolicy.is_purged``) and drops them from
its store (gateway/cache/service.py). Purges older than the longest TTL
cover nothing any more and are forgotten; at most ``MAX_PURGES`` models and
keys are remembered (the oldest are replaced by a purge of everything).
"""

from __future__ import annotations

import time
from typing import Any

from django.db import transaction

from routing.core.cache_policy import TTL_LIMIT
from routing.models import RoutingPolicy
from usage.models import TokenUsage

MAX_PURGES = 500


@transaction.atomic
def purge_cache(*, model: str = "", key_prefix: str = "") -> dict[str, Any]:
    """Purge the cached answers of a model, of a key, or (neither) all of them.

    Returns the purge as recorded: ``{"all": bool, "model": ..., "key": ...,
    "at": unix time}``.
    """
    RoutingPolicy.load()
    policy = RoutingPolicy.objects.select_for_update().get(
        pk=RoutingPolicy.SINGLETON_PK
    )
    now = time.time()
    record = policy.cache_purges if isinstance(policy.cache_purges, dict) else {}
    everything = float(record.get("all") or 0.0)
    horizon = now - TTL_LIMIT
    models = _recent(record.get("models"), horizon, everything)
    keys = _recent(record.get("keys"), horizon, everything)
    if model:
        models[model] = now
    if key_prefix:
        keys[key_prefix] = now
    if not (model or key_prefix) or len(models) + len(keys) > MAX_PURGES:
        everything, models, keys = now, {}, {}
    policy.cache_purges = {"all": everything, "models": models, "keys": keys}
    policy.save()
    return {
        "all": not (model or key_prefix),
        "model": model,
        "key": key_prefix,
        "at": now,
    }


def cache_report(limit: int = 50) -> dict[str, list[dict[str, Any]]]:
    """Hits, hit rate and tokens saved per model and per client key (all
    time, from the usage aggregates), the most hits first."""
    rows = TokenUsage.objects.all()
    report: dict[str, list[dict[str, Any]]] = {}
    for name, by in (("models", "model"), ("keys", "key")):
        found = rows.report(by=[by]).order_by("-cache_hits", "-requests")[:limit]
        report[name] = [
            {
                by: row["model" if by == "model" else "api_key_prefix"],
                **({"key_name": row.get("key_name")} if by == "key" else {}),
                "requests": row["requests"],
                "cache_hits": row["cache_hits"],
                "hit_rate": round(row["cache_hit_rate"], 4),
                "tokens_saved": row["cache_saved_tokens"],
            }
            for row in found
        ]
    return report


def _recent(found: object, horizon: float, everything: float) -> dict[str, float]:
    if not isinstance(found, dict):
        return {}
    return {
        str(name): float(when)
        for name, when in found.items()
        if isinstance(when, int | float) and when > max(horizon, everything)
    }
