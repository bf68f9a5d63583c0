"""The fleet strategy: score each candidate on seven signals, as the seed's table.

=================  ========================================================
signal             points (defaults; every number is a FleetPolicy setting)
=================  ========================================================
1 thermal          hot +50, warm +30, on disk +10, absent 0
2 memory fit       fit ratio > 2: +20, 1.5-2: +15, 1.2-1.5: +8, 1-1.2: +3;
                   below 1 a cold model is eliminated; unknown: 0, kept;
                   a cold model on a node paused for cold loads is
                   eliminated too (routing/core/capacity.py)
3 queue depth      - min(30, depth x 6); depth = in flight + waiting
4 estimated wait   - min(25, (depth x p75 latency (s) + load time) / 10)
5 role affinity    up to +15: parameter count against the backend's tier
6 trend            rising +10, stable +5, falling 0
7 context fit      up to +10: estimated tokens against the loaded window
=================  ========================================================

Priority plays no part in the score; it only breaks ties (candidates come in
priority order and the first best one wins). Everything read here is in the
snapshot or the live stats: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from routing.core.capacity import cold_load_pause, memory_limit, memory_source
from routing.core.fleet_policy import FleetPolicy
from routing.core.stats import LiveStats
from routing.core.types import BackendSpec, ModelSpec
from routing.core.vocabulary import Thermal, Trend

# The estimated latency of one request before MIN_LATENCY_SAMPLES answers were
# timed: a base plus the time to decode HEURISTIC_TOKENS (decoding reads every
# weight once per token, so time grows with size) at the node's memory
# bandwidth: learned from its decoding speed (``observe_decoding``), else
# DEFAULT_BANDWIDTH_GBPS (~200 tokens at ~200 GB/s is ~1 s per GB).
HEURISTIC_BASE_SECONDS = 2.0
HEURISTIC_TOKENS = 200
DEFAULT_BANDWIDTH_GBPS = 200.0
# A decoding speed is learned from streamed answers of at least this many
# reported tokens, over at least this long.
MIN_DECODE_TOKENS = 16
MIN_DECODE_SECONDS = 0.05
# The guess when the model's size is unknown too.
HEURISTIC_UNKNOWN_SECONDS = 5.0

# Role affinity, as fractions of affinity_max_points, by model size class and
# backend tier. Over 30B and under 10B are the seed's; between the two (a
# mid-size model) the medium tier is the best home, then large, then small.
AFFINITY: dict[str, dict[str, float]] = {
    "large_model": {"large": 1.0, "medium": 5 / 15, "small": 0.0},
    "mid_model": {"medium": 1.0, "large": 8 / 15, "small": 3 / 15},
    "small_model": {"small": 1.0, "medium": 8 / 15, "large": 3 / 15},
}
LARGE_MODEL_B = 30.0
SMALL_MODEL_B = 10.0

# Context fit, as fractions of context_fit_max_points, by the share of the
# window the request's estimated tokens would fill.
CONTEXT_FIT: tuple[tuple[float, float], ...] = ((0.5, 1.0), (0.75, 0.6), (1.0, 0.3))

# The most requests at once a node x model is given from its free memory.
MAX_LEARNED_CONCURRENCY = 64


@dataclass(frozen=True, slots=True)
class FleetScore:
    """One candidate's seven signals: each raw value and its points."""

    thermal: Thermal
    thermal_points: float
    fit_ratio: float | None
    fit_points: float
    fits: bool
    depth: int
    queue_points: float
    est_wait_s: float
    wait_from_samples: bool
    # The node's learned memory bandwidth the guess used (None: the default),
    # and the time to load the model there first (0: hot, or no load timed).
    bandwidth_gbps: float | None
    load_s: float
    wait_points: float
    parameters_b: float | None
    tier: str
    affinity_points: float
    trend: Trend
    trend_points: float
    context_window: int | None
    tokens: int
    context_points: float
    # The memory limit read (GB) and where it came from (capacity.memory_source),
    # and why the node takes no cold load now ("": it does; then ``fits`` is
    # False for a model that is not hot).
    memory_limit_gb: float | None = None
    memory_source: str = ""
    paused: str = ""

    @property
    def total(self) -> float:
        """The score: the bonuses minus the two penalties."""
        return (
            self.thermal_points
            + self.fit_points
            + self.affinity_points
            + self.trend_points
            + self.context_points
            - self.queue_points
            - self.wait_points
        )


def score_fleet(
    backend: BackendSpec,
    model: ModelSpec,
    tokens: int,
    stats: LiveStats,
    policy: FleetPolicy,
    now: float,
) -> FleetScore:
    """Score `model` on `backend` for a request of ~`tokens` tokens at wall time `now`.

    ``fits`` is False for a model that is not hot and whose known size
    exceeds the backend's known memory even once its idle models are unloaded
    (the memory of models with requests in flight or waiting stays taken), or
    when the backend is paused for cold loads (``paused`` says why): the
    router eliminates it. A model that fits only by unloading idle ones gets no
    fit points (its fit ratio, on the memory in use now, is below 1).
    """
    thermal = thermal_state(backend.name, model, stats, policy, now)
    hot = thermal is Thermal.HOT
    size = model.memory_gb or 0.0
    limit = memory_limit(backend, stats)
    used = memory_in_use(backend, stats, policy, now)
    fit_ratio = memory_fit_ratio(
        limit, model, None if used is None else used - (size if hot else 0.0)
    )
    # Room once the backend unloads its idle models (what Ollama does).
    room = (
        None
        if hot or fit_ratio is None or fit_ratio >= 1.0
        else memory_fit_ratio(
            limit,
            model,
            memory_in_use(backend, stats, policy, now, busy_only=True),
        )
    )
    paused = "" if hot else cold_load_pause(backend, stats, now)
    depth = stats.queue_depth(backend.name, model.name)
    p75_ms = stats.latency_p75_ms(backend.name, model.name)
    bandwidth = stats.bandwidth_gbps(backend.name)
    per_request = (
        p75_ms / 1000 if p75_ms is not None else heuristic_seconds(model, bandwidth)
    )
    load_rate = None if hot else stats.load_gbps(backend.name)
    load_s = size / load_rate if load_rate else 0.0
    est_wait = depth * per_request + load_s
    window = (
        model.loaded_context
        if thermal is Thermal.HOT and model.loaded_context is not None
        else model.context_length
    )
    trend = stats.trend(backend.name)
    return FleetScore(
        thermal=thermal,
        thermal_points=thermal_points(thermal, policy),
        fit_ratio=fit_ratio,
        fit_points=fit_points(fit_ratio, policy),
        fits=hot
        or (
            not paused
            and (fit_ratio is None or fit_ratio >= 1.0 or (room or 0.0) >= 1.0)
        ),
        depth=depth,
        queue_points=min(
            policy.queue_penalty_max, depth * policy.queue_points_per_request
        ),
        est_wait_s=est_wait,
        wait_from_samples=p75_ms is not None,
        bandwidth_gbps=None if p75_ms is not None else bandwidth,
        load_s=load_s,
        wait_points=min(
            policy.wait_penalty_max, est_wait / policy.wait_seconds_per_point
        ),
        parameters_b=model.parameters_b,
        tier=backend.tier,
        affinity_points=affinity_points(model.parameters_b, backend.tier, policy),
        trend=trend,
        trend_points=trend_points(trend, policy),
        context_window=window,
        tokens=tokens,
        context_points=context_points(tokens, window, policy),
        memory_limit_gb=limit,
        memory_source=memory_source(backend, stats),
        paused=paused,
    )


def thermal_state(
    backend: str, model: ModelSpec, stats: LiveStats, policy: FleetPolicy, now: float
) -> Thermal:
    """How ready `backend` is to run `model` at wall time `now`.

    The latest observation wins. Evidence it is loaded: the last probe listed
    it (as of when it was first seen loaded, ``last_loaded_at``) and its
    keep_alive has not run out, or this process sent or answered a request
    for it there within served_hot_seconds (``LiveStats.mark_hot``). Evidence
    it is not: a probe that saw it unloaded (``last_loaded_at`` of a model
    not loaded), its keep_alive running out, or this process expecting the
    backend to unload it for another model (``LiveStats.mark_evicted``). Hot
    when the newest evidence says loaded. Warm: it was loaded within
    warm_window_seconds. On disk: the backend lists it.
    """
    loaded_at, gone_at = _evidence(backend, model, stats, policy, now)
    if loaded_at is not None and (gone_at is None or loaded_at > gone_at):
        return Thermal.HOT
    last = max(
        (t for t in (loaded_at, gone_at, stats.served_at(backend, model.name)) if t),
        default=None,
    )
    if last is not None and now - last <= policy.warm_window_seconds:
        return Thermal.WARM
    return Thermal.ON_DISK if model.listed else Thermal.ABSENT


def _evidence(
    backend: str, model: ModelSpec, stats: LiveStats, policy: FleetPolicy, now: float
) -> tuple[float | None, float | None]:
    """(newest "loaded" time, newest "not loaded" time), wall clock; None: none.

    A probe's "loaded" without a first-seen time counts as older than any
    other evidence (-inf): it was true at some probe, no telling when.
    """
    loaded: list[float] = []
    gone: list[float] = []
    expired = model.expires_at is not None and model.expires_at <= now
    if model.loaded:
        if expired:
            gone.append(model.expires_at)  # type: ignore[arg-type]
        else:
            loaded.append(
                model.last_loaded_at if model.last_loaded_at is not None else -math.inf
            )
    elif model.last_loaded_at is not None:
        gone.append(model.last_loaded_at)  # when a probe saw it unloaded
    served = stats.served_at(backend, model.name)
    if served is not None and now - served <= policy.served_hot_seconds:
        loaded.append(served)
    evicted = stats.evicted_at(backend, model.name)
    if evicted is not None and now - evicted <= policy.served_hot_seconds:
        # Bounded like a serve mark: by then a probe has seen the unload (and
        # timed it), or the expectation was wrong and the probe's "loaded"
        # stands again.
        gone.append(evicted)
    return max(loaded, default=None), max(gone, default=None)


def believed_loaded(
    backend: BackendSpec, stats: LiveStats, policy: FleetPolicy, now: float
) -> list[ModelSpec]:
    """The models `backend` has loaded now, as far as this process can tell.

    Only those a probe saw loaded or this process marked loaded can be: the
    rest of a long model list is not looked at.
    """
    by_name = backend.models_by_name
    candidates = list(backend.loaded_models)
    seen = {model.name for model in candidates}
    for name in stats.marked_models(backend.name) - seen:
        model = by_name.get(name)
        if model is not None:
            candidates.append(model)
    return [
        model
        for model in candidates
        if thermal_state(backend.name, model, stats, policy, now) is Thermal.HOT
    ]


def memory_in_use(
    backend: BackendSpec,
    stats: LiveStats,
    policy: FleetPolicy,
    now: float,
    *,
    busy_only: bool = False,
) -> float | None:
    """GB the backend's loaded models take (None: a size is unknown).

    With `busy_only`, only the models with requests in flight or waiting
    there: the rest are idle, and Ollama unloads idle models (least recently
    used first) to make room for a model it has to load. Memory the node
    reported in use beyond the models listed here (``memory_other_gb``)
    counts either way: nothing here can tell whether it would be freed.
    """
    used = backend.memory_other_gb
    for model in believed_loaded(backend, stats, policy, now):
        if busy_only and not stats.queue_depth(backend.name, model.name):
            continue
        size = model.memory_gb
        if size is None:
            return None
        used += size
    return used


def evictions_for(
    backend: BackendSpec,
    model: ModelSpec,
    stats: LiveStats,
    policy: FleetPolicy,
    now: float,
) -> list[str]:
    """The idle models `backend` would unload to load `model`, oldest use first.

    Empty when the model is loaded there already, fits in free memory, or
    memory is unknown. Follows Ollama (and the mock): least recently used
    idle models go first until the new one fits.
    """
    ceiling, size = memory_limit(backend, stats), model.memory_gb
    if ceiling is None or size is None:
        return []
    loaded = believed_loaded(backend, stats, policy, now)
    if any(m.name == model.name for m in loaded):
        return []
    if any(m.memory_gb is None for m in loaded):
        return []
    free = ceiling - backend.memory_other_gb - sum(m.memory_gb or 0.0 for m in loaded)
    idle = sorted(
        (m for m in loaded if not stats.queue_depth(backend.name, m.name)),
        key=lambda m: _last_use(backend.name, m, stats),
    )
    gone: list[str] = []
    for victim in idle:
        if free >= size:
            break
        gone.append(victim.name)
        free += victim.memory_gb or 0.0
    return gone


def _last_use(backend: str, model: ModelSpec, stats: LiveStats) -> float:
    served = stats.served_at(backend, model.name)
    if served is not None:
        return served
    return model.last_loaded_at if model.last_loaded_at is not None else -math.inf


def thermal_points(thermal: Thermal, policy: FleetPolicy) -> float:
    """Signal 1's points."""
    return float(
        {
            Thermal.HOT: policy.hot_points,
            Thermal.WARM: policy.warm_points,
            Thermal.ON_DISK: policy.on_disk_points,
            Thermal.ABSENT: 0,
        }[thermal]
    )


def memory_fit_ratio(
    ceiling: float | None, model: ModelSpec, used: float | None
) -> float | None:
    """(ceiling - used) / model size, or None when any of the three is unknown.

    A loaded model's own memory counts as free for it: it needs no more.
    `ceiling` is the backend's memory limit (``capacity.memory_limit``),
    `used` what its loaded models take (``memory_in_use``).
    """
    size = model.memory_gb
    if ceiling is None or used is None or size is None or size <= 0:
        return None
    return (ceiling - used) / size


def fit_points(ratio: float | None, policy: FleetPolicy) -> float:
    """Signal 2's points (0 when memory is unknown or the model does not fit)."""
    if ratio is None or ratio < 1.0:
        return 0.0
    if ratio > 2.0:
        return float(policy.fit_over_2_points)
    if ratio >= 1.5:
        return float(policy.fit_over_1_5_points)
    if ratio >= 1.2:
        return float(policy.fit_over_1_2_points)
    return float(policy.fit_over_1_points)


def heuristic_seconds(model: ModelSpec, bandwidth_gbps: float | None = None) -> float:
    """One request's latency, guessed from the model's size and the node's
    memory bandwidth (before samples; None: DEFAULT_BANDWIDTH_GBPS)."""
    size = model.memory_gb
    if size is None:
        return HEURISTIC_UNKNOWN_SECONDS
    bandwidth = bandwidth_gbps or DEFAULT_BANDWIDTH_GBPS
    return HEURISTIC_BASE_SECONDS + HEURISTIC_TOKENS * size / bandwidth


def observe_decoding(
    stats: LiveStats,
    backend: BackendSpec,
    model: ModelSpec,
    tokens: int,
    seconds: float,
) -> None:
    """Learn `backend`'s memory bandwidth from one streamed answer: `tokens`
    decoded in `seconds` read the model's weights once each.

    Skipped for short answers (under MIN_DECODE_TOKENS or
    MIN_DECODE_SECONDS: their time is mostly overhead) and unknown sizes.
    """
    size = model.memory_gb
    if size is None or tokens < MIN_DECODE_TOKENS or seconds < MIN_DECODE_SECONDS:
        return
    stats.observe_bandwidth(backend.name, tokens / seconds * size)


def observe_load(
    stats: LiveStats, backend: BackendSpec, model: ModelSpec, seconds: float
) -> None:
    """Learn how fast `backend` loads models from one load of `model` that
    took `seconds` (a warm-up; under MIN_DECODE_SECONDS: skipped)."""
    size = model.memory_gb
    if size is None or seconds < MIN_DECODE_SECONDS:
        return
    stats.observe_load_rate(backend.name, size / seconds)


def affinity_points(
    parameters_b: float | None, tier: str, policy: FleetPolicy
) -> float:
    """Signal 5's points: 0 when the parameter count or the tier is unknown."""
    if parameters_b is None or not tier:
        return 0.0
    if parameters_b > LARGE_MODEL_B:
        size_class = "large_model"
    elif parameters_b < SMALL_MODEL_B:
        size_class = "small_model"
    else:
        size_class = "mid_model"
    return round(AFFINITY[size_class].get(tier, 0.0) * policy.affinity_max_points, 2)


def trend_points(trend: Trend, policy: FleetPolicy) -> float:
    """Signal 6's points."""
    return float(
        {
            Trend.RISING: policy.trend_rising_points,
            Trend.STABLE: policy.trend_stable_points,
            Trend.FALLING: policy.trend_falling_points,
        }[trend]
    )


def context_points(tokens: int, window: int | None, policy: FleetPolicy) -> float:
    """Signal 7's points: full when the request fills at most half the window.

    A request larger than the loaded window gets 0: the backend would reload
    the model with a larger one. An unknown window gets 0 (signal skipped).
    """
    if window is None:
        return 0.0
    for share, fraction in CONTEXT_FIT:
        if tokens <= window * share:
            return round(fraction * policy.context_fit_max_points, 2)
    return 0.0


def learned_concurrency(
    backend: BackendSpec,
    model: ModelSpec,
    stats: LiveStats,
    policy: FleetPolicy,
    now: float,
) -> int | None:
    """Requests `model` may run at once on `backend`, as the node's numbers say.

    The node's own slot count when it reports one (llama.cpp). Else, with the
    node's memory limit, the model's KV cache per token and its context window
    known: one request, plus one per KV footprint (window x bytes per token)
    that fits in the memory left once the model is loaded (1 to
    MAX_LEARNED_CONCURRENCY). None when unknown: no limit but the operator's.
    """
    if backend.slots is not None:
        return backend.slots
    per_token = model.kv_bytes_per_token
    window = model.loaded_context or model.context_length
    limit = memory_limit(backend, stats)
    used = memory_in_use(backend, stats, policy, now)
    if per_token is None or window is None or limit is None or used is None:
        return None
    hot = thermal_state(backend.name, model, stats, policy, now) is Thermal.HOT
    free = limit - used - (0.0 if hot else model.memory_gb or 0.0)
    per_request = per_token * window / 1e9
    extra = math.floor(max(free, 0.0) / per_request) if per_request > 0 else 0
    return max(1, min(MAX_LEARNED_CONCURRENCY, 1 + extra))
