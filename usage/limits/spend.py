"""Budgets' truth: spend per key from the usage tables, and reconciling with it.

The usage pipeline (exactly-once records rolled up into ``KeySpend``) is the
source of truth; the limiter's counters are fast copies that also count what
was settled but not yet rolled up. Reconciling raises each counter to at
least the rolled-up figure (never lowers it: what is not rolled up yet would
be lost), which repairs counters lost with Redis or a restart. In production
the beat task does it for the shared Redis counters and also drops the budget
holds of serving processes that died; in the embedded default each gateway
does it for its own counters.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import cast

import redis
from django.db.models import Q

from usage.limits.policy import period_id, team_prefix
from usage.limits.redis_keys import budget_key, budget_ttl, liveness_key
from usage.limits.scripts import RAISE_SPENT
from usage.models import ApiKey, KeySpend, Team

logger = logging.getLogger(__name__)


_BUDGETED = Q(budget_tokens__isnull=False) | Q(budget_usd__isnull=False)


def read_budget_spend(
    now: float | None = None,
) -> dict[tuple[str, str], tuple[int, int]]:
    """Return (tokens, nano-USD) rolled up per (counter prefix, current period
    id) for every active key with a budget and every team with one (a team's
    spend is its keys' spend: the keys that are in it now)."""
    moment = datetime.now(UTC) if now is None else datetime.fromtimestamp(now, UTC)
    spend: dict[tuple[str, str], tuple[int, int]] = {}
    for prefix, (tokens, nanos, pid) in _budget_spend(moment).items():
        spend[(prefix, pid)] = (tokens, nanos)
    return spend


def budget_periods() -> dict[str, str]:
    """The budget period (day, month, total) of every budgeted key and team,
    by counter prefix."""
    periods = dict(
        ApiKey.objects.active().filter(_BUDGETED).values_list("prefix", "budget_period")
    )
    for team_id, period in Team.objects.filter(_BUDGETED).values_list(
        "pk", "budget_period"
    ):
        periods[team_prefix(team_id)] = period
    return periods


def _budget_spend(moment: datetime) -> dict[str, tuple[int, int, str]]:
    members: dict[str, list[str]] = {}  # team prefix -> its keys' prefixes
    for team_id, key in ApiKey.objects.filter(
        team__in=Team.objects.filter(_BUDGETED)
    ).values_list("team_id", "prefix"):
        members.setdefault(team_prefix(team_id), []).append(key)
    by_period: dict[str, list[str]] = {}
    for prefix, period in budget_periods().items():
        by_period.setdefault(period, []).append(prefix)
    spend: dict[str, tuple[int, int, str]] = {}
    for period, prefixes in by_period.items():
        pid = period_id(period, moment.timestamp())
        keys = {k for p in prefixes for k in members.get(p, [p])}
        totals = (
            KeySpend.objects.filter(api_key_prefix__in=keys)
            .for_period(period, moment)
            .spend_by_key()
        )
        for prefix in prefixes:
            parts = [totals.get(key, (0, 0)) for key in members.get(prefix, [prefix])]
            spend[prefix] = (
                sum(tokens for tokens, _ in parts),
                sum(nanos for _, nanos in parts),
                pid,
            )
    return spend


def reconcile_shared_spend(url: str) -> int:
    """Raise the Redis budget counters to the rolled-up spend and drop the holds
    of dead serving processes; return how many keys and teams were reconciled."""
    spend = read_budget_spend()
    if not spend:
        return 0
    periods = budget_periods()
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        raise_spent = client.register_script(RAISE_SPENT)
        for (prefix, period), (tokens, nanos) in spend.items():
            key = budget_key(prefix, period)
            raise_spent(
                keys=[key], args=[tokens, nanos, budget_ttl(periods.get(prefix, ""))]
            )
            _drop_dead_holds(client, key)
    finally:
        client.close()
    return len(spend)


def _drop_dead_holds(client: redis.Redis, key: str) -> None:
    names = cast("list[bytes]", client.hkeys(key))
    fields = [field.decode() for field in names if field[:3] in (b"ht:", b"hn:")]
    processes = sorted({field[3:] for field in fields})
    dead = {p for p in processes if not client.exists(liveness_key(p))}
    stale = [field for field in fields if field[3:] in dead]
    if stale:
        logger.info("Dropped %d budget holds of stopped serving processes", len(stale))
        client.hdel(key, *stale)
