"""What a client key may do, and what a model costs: frozen values, no Django.

The snapshot (routing/snapshot.py) builds one ``KeyPolicy`` per active key and
one ``Price`` per served model; the gateway reads only these on the request
path. Money is counted in integer nano-USD (1e-9 USD) so that sums are exact:
a price of $X per million tokens is X*1000 nano-USD per token.
"""

from __future__ import annotations

import enum
import fnmatch
import re
from calendar import monthrange
from dataclasses import dataclass, field
from datetime import UTC, datetime

from nexus_lib.model_patterns import is_glob

NANOS_PER_USD = 1_000_000_000


class BudgetPeriod(enum.StrEnum):
    DAY = "day"
    MONTH = "month"
    TOTAL = "total"

    @classmethod
    def choices(cls) -> list[tuple[str, str]]:
        return [
            (cls.DAY, "per UTC day"),
            (cls.MONTH, "per UTC month"),
            (cls.TOTAL, "all time"),
        ]


def period_id(period: str, now: float) -> str:
    """The budget period that holds at Unix time `now` ("d20261124", ...)."""
    if period == BudgetPeriod.TOTAL:
        return "all"
    moment = datetime.fromtimestamp(now, UTC)
    if period == BudgetPeriod.DAY:
        return f"d{moment:%Y%m%d}"
    return f"m{moment:%Y%m}"


def period_end(period: str, now: float) -> float | None:
    """Unix time when the budget period holding at `now` ends (None: never)."""
    if period == BudgetPeriod.TOTAL:
        return None
    moment = datetime.fromtimestamp(now, UTC)
    start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == BudgetPeriod.DAY:
        return start.timestamp() + 86_400
    days = monthrange(moment.year, moment.month)[1]
    return start.replace(day=1).timestamp() + days * 86_400


@dataclass(frozen=True, slots=True)
class Price:
    """A model's price in nano-USD per token, in and out.

    Input tokens read from a prompt cache cost ``cached_input_nanos`` and those
    written to one ``cache_write_nanos``; None is the input price.
    """

    input_nanos: int = 0
    output_nanos: int = 0
    cached_input_nanos: int | None = None
    cache_write_nanos: int | None = None
    # An answer from the response cache, per token of it (prompt and output).
    cache_hit_nanos: int = 0
    # What a batch job's line costs, as a fraction of the price (1: the same).
    batch_factor: float = 1.0

    def cost(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> int:
        """Return the cost of a request in nano-USD (exact).

        ``prompt_tokens`` counts every input token, the cached ones included:
        uncached input x input price + cache reads x cached input price +
        cache writes x cache write price + output x output price.
        """
        cost = prompt_tokens * self.input_nanos + completion_tokens * self.output_nanos
        if cache_read_tokens and self.cached_input_nanos is not None:
            cost += cache_read_tokens * (self.cached_input_nanos - self.input_nanos)
        if cache_write_tokens and self.cache_write_nanos is not None:
            cost += cache_write_tokens * (self.cache_write_nanos - self.input_nanos)
        return max(cost, 0)

    def batch_cost(self, cost: int) -> int:
        """Return what a batch line costs that would cost `cost` (nano-USD)."""
        return cost if self.batch_factor == 1.0 else round(cost * self.batch_factor)

    def cache_hit_cost(self, total_tokens: int) -> int:
        """Return the cost of a cache hit of `total_tokens` in nano-USD."""
        return total_tokens * self.cache_hit_nanos


FREE = Price()


class _Limits:
    """What a key's and a team's limits answer alike (their fields: rpm, tpm,
    max_concurrency, budget_tokens, budget_nanos)."""

    __slots__ = ()
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    budget_tokens: int | None
    budget_nanos: int | None

    @property
    def has_budget(self) -> bool:
        """Whether a budget of its own holds (tokens or money)."""
        return self.budget_tokens is not None or self.budget_nanos is not None

    @property
    def has_own_limits(self) -> bool:
        return (
            self.rpm is not None
            or self.tpm is not None
            or self.max_concurrency is not None
            or self.has_budget
        )


@dataclass(frozen=True, slots=True)
class TeamPolicy(_Limits):
    """A team's limits and budgets, shared by its keys (None: no limit).

    ``prefix`` names the team's counters (``team:<id>``), as a key's prefix
    names the key's.
    """

    prefix: str
    name: str = ""
    max_concurrency: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    budget_period: str = BudgetPeriod.MONTH
    budget_tokens: int | None = None
    budget_nanos: int | None = None

    @property
    def is_limited(self) -> bool:
        return self.has_own_limits


def team_prefix(team_id: int) -> str:
    """The counter prefix of a team (never a key's: those start with "nx-")."""
    return f"team:{team_id}"


@dataclass(frozen=True, slots=True)
class KeyPolicy(_Limits):
    """One client key's allow-list, expiry, limits and budgets (None: no limit)."""

    prefix: str
    allowed_models: tuple[str, ...] = ()
    expires_at: float | None = None  # Unix time
    max_concurrency: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    budget_period: str = BudgetPeriod.MONTH
    budget_tokens: int | None = None
    budget_nanos: int | None = None
    # May pull, push, copy, create and delete models on Ollama backends.
    can_manage_models: bool = False
    # The team whose limits the key also draws on; None when it has none, or
    # its team limits nothing.
    team: TeamPolicy | None = None
    _exact: frozenset[str] = field(init=False, repr=False, compare=False)
    _glob: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        exact = frozenset(p for p in self.allowed_models if not is_glob(p))
        globs = [fnmatch.translate(p) for p in self.allowed_models if is_glob(p)]
        object.__setattr__(self, "_exact", exact)
        object.__setattr__(
            self, "_glob", re.compile("|".join(globs)) if globs else None
        )

    @property
    def has_any_budget(self) -> bool:
        """Whether a budget holds the key's requests: its own or its team's."""
        return self.has_budget or (self.team is not None and self.team.has_budget)

    @property
    def is_limited(self) -> bool:
        """Whether admission must ask the limiter (any limit or budget set, the
        key's or its team's)."""
        return self.has_own_limits or self.team is not None

    def is_expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def allows(self, *names: str) -> bool:
        """Whether the allow-list admits any of `names` (a model, its alias target)."""
        if not self.allowed_models:
            return True
        for name in names:
            if name in self._exact:
                return True
            if self._glob is not None and self._glob.fullmatch(name):
                return True
        return False


UNLIMITED_KEY = KeyPolicy(prefix="")

# A key's own limits or its team's: the limiter treats both alike.
LimitLayer = KeyPolicy | TeamPolicy


def resolve_prices(
    prices: dict[str, Price], models: list[str] | tuple[str, ...] | set[str]
) -> dict[str, Price]:
    """Map every model name to its price: the exact entry, else the longest pattern.

    `prices` maps names or glob patterns to prices; models without any match
    are left out (free).
    """
    patterns = sorted(
        ((p, price) for p, price in prices.items() if is_glob(p)),
        key=lambda item: -len(item[0]),
    )
    resolved: dict[str, Price] = {}
    for model in models:
        if model in prices:
            resolved[model] = prices[model]
            continue
        for pattern, price in patterns:
            if fnmatch.fnmatchcase(model, pattern):
                resolved[model] = price
                break
    return resolved
