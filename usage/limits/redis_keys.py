"""The limiter's Redis keys: their names, and how long they live."""

from __future__ import annotations

from usage.limits.policy import BudgetPeriod

# A concurrency slot is a lease that lives this long unless its process renews
# it (a process killed without warning frees its slots when they expire).
LEASE_SECONDS = 60
# Budget counters of a period outlive it a little (reports read the database).
_BUDGET_TTL = {BudgetPeriod.DAY: 3 * 86_400, BudgetPeriod.MONTH: 40 * 86_400}


def counter_key(prefix: str, what: str) -> str:
    # The braces put all of one client key's counters in one cluster slot.
    return f"nx:{{{prefix}}}:{what}"


def budget_key(prefix: str, period: str) -> str:
    return counter_key(prefix, f"budget:{period}")


def backend_key(backend: str) -> str:
    return f"nx:backend:{{{backend}}}:concurrency"


def liveness_key(process: str) -> str:
    return f"nx:process:{process}"


def budget_ttl(policy_period: str) -> int:
    return _BUDGET_TTL.get(policy_period, 0)  # type: ignore[call-overload]
