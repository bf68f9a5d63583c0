"""Admission control's settings and the hysteresis band they give a pool.

One frozen ``AdmissionSettings`` per configuration version (built from the
routing policy by the snapshot); ``problems()`` reports every invalid value by
field name, so the admin, the TOML importer and the constructor say the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

from routing.admission.vocabulary import Criticality, FlowKey, Sizing, StockUnit

MAX_CAPACITY = 1_000_000
MAX_TTL_SECONDS = 3600.0
MAX_PER_BACKEND = 100_000.0
MAX_WEIGHT = 1000.0
MAX_OUTPUT_TOKENS = 10_000_000
MAX_TOKENS_PER_BACKEND = 100_000_000.0
# In requests mode nothing limits the tokens, in tokens mode a pool whose
# backends do not all say their max_concurrency has no request limit.
NO_LIMIT = 1 << 62
SHARE_NAMES = ("critical_share", "default_share", "sheddable_share")


@dataclass(frozen=True, slots=True)
class Band:
    """The stock limits of one pool in one serving process.

    ``bypass_limit``: a request goes straight through while the stock (in
    requests) is below it and nothing waits; ``dispatch_limit``: a waiting
    request is sent while the stock is below it. The token limits do the same
    for the stock in tokens (the sizes of the requests let through) and
    always hold too: with ``stock_unit = "requests"`` they never bind, with
    "tokens" the request limits bind only where every backend says its
    max_concurrency (the router sends it no more). ``lower``, ``upper`` and
    ``watermark`` are the (fractional) band of the whole gateway in the
    stock's unit, for the gauges.
    """

    lower: float
    upper: float
    watermark: float
    dispatch_limit: int
    bypass_limit: int
    token_dispatch_limit: int = NO_LIMIT
    token_bypass_limit: int = NO_LIMIT


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """What the routing policy says about admission control.

    ``lower_bound_per_backend`` / ``upper_bound_per_backend`` override the band
    that ``watermark_per_backend`` ± ``percentage_deviation_for_bounds`` gives
    when set (both or either). ``total_capacity`` and ``flow_capacity`` bound
    the requests waiting in the whole gateway and per flow (every pool and,
    with Redis, every serving process: ``gateway.admission_places``; each
    pool's queue keeps them too). ``critical_reserved`` queue places are kept
    for critical requests; the others may fill ``total_capacity`` minus it.
    ``model_weights`` multiply a flow's weight by the model's (default 1);
    ``model_output_tokens`` replace ``default_output_tokens`` for the models
    they name (a request without max_tokens). ``critical_share``,
    ``default_share`` and ``sheddable_share`` split the dispatches between
    the criticality levels while more than one waits (0: only when no level
    with a share waits).
    """

    enabled: bool = True
    flow_key: FlowKey = FlowKey.KEY
    sizing: Sizing = Sizing.TOKENS
    default_output_tokens: int = 256
    total_capacity: int = 1000
    flow_capacity: int = 100
    critical_reserved: int = 100
    queue_ttl: float = 30.0
    watermark_per_backend: float = 4.0
    percentage_deviation_for_bounds: float = 0.1
    lower_bound_per_backend: float | None = None
    upper_bound_per_backend: float | None = None
    model_weights: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({})
    )
    model_output_tokens: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType({})
    )
    critical_share: int = 70
    default_share: int = 25
    sheddable_share: int = 5
    stock_unit: StockUnit = StockUnit.REQUESTS
    watermark_tokens_per_backend: float | None = None
    # The fraction of a pool's dispatch limit batch lines leave free for
    # interactive arrivals (at least one request; routing.admission.batch_lane).
    batch_headroom: float = 0.125

    def __post_init__(self) -> None:
        object.__setattr__(self, "flow_key", FlowKey(self.flow_key))
        object.__setattr__(self, "sizing", Sizing(self.sizing))
        object.__setattr__(self, "stock_unit", StockUnit(self.stock_unit))
        object.__setattr__(
            self, "model_weights", MappingProxyType(dict(self.model_weights))
        )
        object.__setattr__(
            self,
            "model_output_tokens",
            MappingProxyType(dict(self.model_output_tokens)),
        )
        problems = self.problems()
        if problems:
            raise ValueError(
                "; ".join(f"{name}: {message}" for name, message in problems.items())
            )

    @classmethod
    def check(cls, **values: object) -> dict[str, str]:
        """The problems() of settings with `values`, without raising."""
        unchecked = object.__new__(cls)
        defaults = cls()
        for item in fields(cls):
            value = values.get(item.name, getattr(defaults, item.name))
            object.__setattr__(unchecked, item.name, value)
        return unchecked.problems()

    @property
    def request_tokens(self) -> float:
        """The size a backend slot is counted at in tokens: a request whose
        prompt is as long as the default output (twice default_output_tokens)."""
        return float(max(1, 2 * self.default_output_tokens))

    @property
    def tokens_per_backend(self) -> float:
        """The token watermark per ready backend without a max_concurrency:
        the one set, else the request watermark times ``request_tokens``
        (so that requests of that size see the same band as in requests)."""
        if self.watermark_tokens_per_backend is not None:
            return self.watermark_tokens_per_backend
        return self.watermark_per_backend * self.request_tokens

    @property
    def shares(self) -> Mapping[Criticality, int]:
        """Each criticality level's share of the dispatches."""
        return {
            Criticality.CRITICAL: self.critical_share,
            Criticality.DEFAULT: self.default_share,
            Criticality.SHEDDABLE: self.sheddable_share,
        }

    @property
    def lower_per_backend(self) -> float:
        """The band's lower bound per ready backend."""
        if self.lower_bound_per_backend is not None:
            return self.lower_bound_per_backend
        return self.watermark_per_backend * (1 - self.percentage_deviation_for_bounds)

    @property
    def upper_per_backend(self) -> float:
        """The band's upper bound per ready backend."""
        if self.upper_bound_per_backend is not None:
            return self.upper_bound_per_backend
        return self.watermark_per_backend * (1 + self.percentage_deviation_for_bounds)

    def problems(self) -> dict[str, str]:
        """Every invalid value, by field name (empty when all is well)."""
        found: dict[str, str] = {}
        for name in ("total_capacity", "flow_capacity"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_CAPACITY:
                found[name] = f"must be from 1 to {MAX_CAPACITY}, got {value}"
        if not 0 <= self.critical_reserved <= self.total_capacity:
            found["critical_reserved"] = (
                f"must be from 0 to total_capacity ({self.total_capacity}), "
                f"got {self.critical_reserved}"
            )
        if self.flow_capacity > self.total_capacity and "flow_capacity" not in found:
            found["flow_capacity"] = (
                f"cannot exceed total_capacity ({self.total_capacity}), "
                f"got {self.flow_capacity}"
            )
        if not 0 < self.queue_ttl <= MAX_TTL_SECONDS:
            found["queue_ttl"] = (
                f"must be more than 0 and at most {MAX_TTL_SECONDS:g} seconds, "
                f"got {self.queue_ttl:g}"
            )
        if not 0 <= self.default_output_tokens <= MAX_OUTPUT_TOKENS:
            found["default_output_tokens"] = (
                f"must be from 0 to {MAX_OUTPUT_TOKENS}, "
                f"got {self.default_output_tokens}"
            )
        for model, tokens in self.model_output_tokens.items():
            if (
                not isinstance(tokens, int)
                or isinstance(tokens, bool)
                or not 0 <= tokens <= MAX_OUTPUT_TOKENS
            ):
                found["model_output_tokens"] = (
                    f"the output tokens of {model!r} must be a whole number from "
                    f"0 to {MAX_OUTPUT_TOKENS}, got {tokens!r}"
                )
                break
        if not _finite_in(
            self.watermark_per_backend, 0, MAX_PER_BACKEND, low_open=True
        ):
            found["watermark_per_backend"] = (
                f"must be more than 0 and at most {MAX_PER_BACKEND:g}, "
                f"got {self.watermark_per_backend:g}"
            )
        deviation = self.percentage_deviation_for_bounds
        if not _finite_in(deviation, 0, 1, low_open=True) or deviation >= 1:
            found["percentage_deviation_for_bounds"] = (
                f"must be between 0 and 1 (exclusive), got {deviation:g}"
            )
        lower, upper = self.lower_bound_per_backend, self.upper_bound_per_backend
        if lower is not None and not _finite_in(lower, 0, MAX_PER_BACKEND):
            found["lower_bound_per_backend"] = (
                f"must be from 0 to {MAX_PER_BACKEND:g}, got {lower:g}"
            )
        if upper is not None and not _finite_in(upper, 0, MAX_PER_BACKEND, True):
            found["upper_bound_per_backend"] = (
                f"must be more than 0 and at most {MAX_PER_BACKEND:g}, got {upper:g}"
            )
        if (
            not found.keys()
            & {
                "lower_bound_per_backend",
                "upper_bound_per_backend",
                "watermark_per_backend",
                "percentage_deviation_for_bounds",
            }
            and self.lower_per_backend > self.upper_per_backend
        ):
            found["lower_bound_per_backend"] = (
                f"lower_bound_per_backend ({self.lower_per_backend:g}) cannot be "
                f"above upper_bound_per_backend ({self.upper_per_backend:g})"
            )
        shares = [getattr(self, name) for name in SHARE_NAMES]
        for name, share in zip(SHARE_NAMES, shares, strict=True):
            if (
                not isinstance(share, int)
                or isinstance(share, bool)
                or not 0 <= share <= 100
            ):
                found[name] = f"must be a whole number from 0 to 100, got {share!r}"
        if not found.keys() & set(SHARE_NAMES) and not any(shares):
            found["critical_share"] = (
                "one of critical_share, default_share and sheddable_share must "
                "be above 0"
            )
        if not _finite_in(self.batch_headroom, 0, 1) or self.batch_headroom >= 1:
            found["batch_headroom"] = (
                f"must be from 0 to less than 1, got {self.batch_headroom!r}"
            )
        per_backend = self.watermark_tokens_per_backend
        if per_backend is not None and not _finite_in(
            per_backend, 0, MAX_TOKENS_PER_BACKEND, low_open=True
        ):
            found["watermark_tokens_per_backend"] = (
                f"must be more than 0 and at most {MAX_TOKENS_PER_BACKEND:g}, "
                f"got {per_backend!r}"
            )
        for model, weight in self.model_weights.items():
            if not _finite_in(weight, 0, MAX_WEIGHT, low_open=True):
                found["model_weights"] = (
                    f"the weight of {model!r} must be more than 0 and at most "
                    f"{MAX_WEIGHT:g}, got {weight!r}"
                )
                break
        return found

    def band(
        self,
        ready_backends: int,
        index: int = 0,
        processes: int = 1,
        capacities: tuple[int, ...] = (),
    ) -> Band:
        """The band of a pool of `ready_backends`, this process's share of it.

        `capacities` are the max_concurrency of the pool's ready backends that
        declare one (the others use the policy's per-backend bounds). Such a
        backend runs that many requests at once and the router sends it no
        more, so its band is exactly that (lower = upper = max_concurrency):
        a band above it would turn waiting into the router's "at capacity"
        503, one below it would keep requests waiting while a slot is free.
        Under the fleet strategy the caller adds what the backend's fleet
        lines may hold (``Policy.waits_at_backends``): there requests wait
        for the backend the fleet chose rather than here.

        The gateway's band is the sum over the ready backends. Its
        whole-request limits (a bypass admits while the stock is below the
        upper bound, so the stock can reach its ceiling) are split between the
        `processes` serving processes, the remainder to the lowest indexes, so
        that the shares add up to the gateway's limits; every process keeps at
        least one request, or it could never send anything.

        With ``stock_unit = "tokens"`` the same band is counted in tokens
        (``_token_band``).
        """
        others = max(0, ready_backends - len(capacities))
        slots = sum(capacities)
        lower = self.lower_per_backend * others + slots
        upper = self.upper_per_backend * others + slots
        watermark = self.watermark_per_backend * others + slots
        if self.stock_unit is StockUnit.TOKENS:
            return self._token_band(others, slots, index, processes)
        return Band(
            lower=lower,
            upper=upper,
            watermark=watermark,
            dispatch_limit=_share(math.ceil(lower - 1e-9), index, processes),
            bypass_limit=_share(math.ceil(upper - 1e-9), index, processes),
        )

    def _token_band(self, others: int, slots: int, index: int, processes: int) -> Band:
        """The band in tokens: the per-backend bounds scaled from requests to
        ``tokens_per_backend``, a backend slot counted at ``request_tokens``."""
        scale = self.tokens_per_backend / self.watermark_per_backend
        per_slot = self.request_tokens
        lower = self.lower_per_backend * scale * others + slots * per_slot
        upper = self.upper_per_backend * scale * others + slots * per_slot
        watermark = self.tokens_per_backend * others + slots * per_slot
        requests = NO_LIMIT if others else _share(slots, index, processes)
        return Band(
            lower=lower,
            upper=upper,
            watermark=watermark,
            dispatch_limit=requests,
            bypass_limit=requests,
            token_dispatch_limit=_share(math.ceil(lower - 1e-9), index, processes),
            token_bypass_limit=_share(math.ceil(upper - 1e-9), index, processes),
        )

    def weight_of(self, model: str) -> float:
        """The model's weight (1 unless the policy names it)."""
        return self.model_weights.get(model, 1.0)

    def output_tokens_of(self, *models: str) -> int:
        """The output size assumed for a request without max_tokens.

        The first of `models` (the requested name, then its alias target)
        that ``model_output_tokens`` names, else ``default_output_tokens``.
        """
        per_model = self.model_output_tokens
        if per_model:
            for model in models:
                tokens = per_model.get(model)
                if tokens is not None:
                    return tokens
        return self.default_output_tokens

    def size_of(
        self, prompt_tokens: int, max_tokens: int | None, *models: str
    ) -> float:
        """A request's size in the fair queue (tokens, or 1 with fixed sizing).

        The estimated prompt tokens plus max_tokens, or the output size of
        the model (``output_tokens_of(*models)``) when the request sets none.
        """
        if self.sizing is Sizing.FIXED:
            return 1.0
        if max_tokens is None:
            max_tokens = self.output_tokens_of(*models)
        return float(max(1, prompt_tokens + max_tokens))


def _share(limit: int, index: int, processes: int) -> int:
    processes = max(1, processes)
    index = min(max(0, index), processes - 1)
    share = limit // processes + (1 if index < limit % processes else 0)
    return max(1, share)


def _finite_in(value: float, low: float, high: float, low_open: bool = False) -> bool:
    if not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return (value > low if low_open else value >= low) and value <= high
