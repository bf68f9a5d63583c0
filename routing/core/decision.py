"""The record of one routing decision: what was tried, chosen, excluded and why.

The router captures only what it read (each candidate's load and latency) and
builds the readable parts (candidates with score components, exclusions with
reasons, the retry order) when first asked, so that routing a request does not
pay for its explanation.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from routing.core.errors import RoutingError
from routing.core.fleet import FleetScore
from routing.core.prefix import PrefixChoice
from routing.core.requirements import RequestRequirements
from routing.core.scoring import ScoreComponents, ScoringWeights, score_backend
from routing.core.shapes import (
    AttemptDict,
    CandidateDict,
    CapabilitiesDict,
    DecisionDict,
    ErrorDict,
    ExclusionDict,
    FleetSignalsDict,
    TargetDict,
)
from routing.core.strategies import order_retries, pick_smart
from routing.core.traffic import SplitChoice
from routing.core.types import ModelRoutes, PreparedTarget, Target
from routing.core.vocabulary import Reason, Strategy


class Via(enum.StrEnum):
    """How the served model was reached from the requested one."""

    DIRECT = "direct"
    ALIAS = "alias"
    FALLBACK = "fallback"


class Role(enum.StrEnum):
    """Why a model was tried."""

    REQUESTED = "requested"
    ALIAS = "alias"
    FALLBACK = "fallback"


class Outcome(enum.StrEnum):
    """What trying one model came to."""

    ROUTED = "routed"
    NOT_FOUND = "not_found"
    NO_HEALTHY_BACKEND = "no_healthy_backend"
    CAPABILITY_MISMATCH = "capability_mismatch"


CAPABILITY_NAMES: dict[Reason, str] = {
    Reason.NO_VISION: "vision",
    Reason.NO_TOOLS: "tools",
    Reason.NO_JSON_MODE: "json_mode",
    Reason.CONTEXT_TOO_SHORT: "context_length",
}

# How a reason reads in "No healthy backend ... (2 unhealthy, 1 draining)".
_SUMMARY_PHRASES: dict[Reason, str] = {
    Reason.BACKEND_DISABLED: "disabled",
    Reason.MODEL_DISABLED: "with the model disabled",
    Reason.UNHEALTHY: "unhealthy",
    Reason.DRAINING: "draining",
    Reason.HEALTH_UNKNOWN: "not yet health-checked",
    Reason.HEALTH_STALE: "with a stale health check",
    Reason.AT_CAPACITY: "at max concurrency",
    Reason.CIRCUIT_OPEN: "with an open circuit breaker",
    Reason.ERROR_CACHED: "with a connection failure moments ago",
    Reason.NO_VISION: "without vision",
    Reason.NO_TOOLS: "without tools",
    Reason.NO_JSON_MODE: "without JSON mode",
    Reason.CONTEXT_TOO_SHORT: "with too short a context",
    Reason.NO_MEMORY: "without the memory to load it",
    Reason.COLD_LOADS_PAUSED: "paused for cold loads",
    Reason.CAPABILITY_UNCONFIRMED: "with capability support unknown",
}


@dataclass(frozen=True)
class Candidate:
    """A backend that could serve the request, with its score components."""

    target: Target
    in_flight: int
    latency_ms: float | None
    score: ScoreComponents
    # The fleet strategy's seven signals (None under the other strategies).
    fleet: FleetScore | None = None

    def as_dict(self) -> CandidateDict:
        """Return the JSON shape (with "fleet" under the fleet strategy)."""
        backend = self.target.backend
        shape: CandidateDict = {
            "backend": backend.name,
            "model": self.target.model.name,
            "priority": backend.priority,
            "in_flight": self.in_flight,
            "max_concurrency": backend.max_concurrency,
            "latency_ms": _round(self.latency_ms),
            "capabilities": capabilities_dict(self.target),
            "score": {
                "priority": round(self.score.priority, 2),
                "load": round(self.score.load, 2),
                "latency": round(self.score.latency, 2),
                "total": round(self.score.total, 2),
            },
        }
        if self.fleet is not None:
            shape["fleet"] = fleet_signals_dict(self.fleet)
        return shape


@dataclass(frozen=True)
class Exclusion:
    """A backend listing the model that was not a candidate, and every reason."""

    target: Target
    reasons: tuple[Reason, ...]
    detail: str

    def as_dict(self) -> ExclusionDict:
        """Return the JSON shape."""
        return {
            "backend": self.target.backend.name,
            "model": self.target.model.name,
            "reasons": [str(r) for r in self.reasons],
            "detail": self.detail,
            "capabilities": capabilities_dict(self.target),
        }


@dataclass(eq=False)
class Attempt:
    """Trying one model name: its candidates, its exclusions, its outcome.

    Built by the router; treat it as read-only.
    """

    model: str
    role: Role
    routes: ModelRoutes | None
    requirements: RequestRequirements
    weights: ScoringWeights
    # Parallel sequences, one item per candidate (the hot path builds flat lists
    # rather than an object per backend): the target, the in-flight count and
    # latency it read, and the smart strategy's score (empty otherwise).
    survivors: Sequence[PreparedTarget] = ()
    in_flight: Sequence[int] = ()
    latencies: Sequence[float | None] = ()
    totals: Sequence[float] = ()
    # Routable targets that failed a capability or capacity check, with the
    # in-flight count read at the time.
    rejected: Sequence[tuple[PreparedTarget, int]] = ()
    # Names of routable backends skipped because their circuit breaker was open.
    circuit_open: frozenset[str] = frozenset()
    # Names of routable backends skipped because a connection to them failed
    # moments ago (the error cache).
    error_cached: frozenset[str] = frozenset()
    # Candidates whose support for a needed capability is unknown, set aside
    # because others confirm it: tried after the survivors.
    unconfirmed: Sequence[PreparedTarget] = ()
    # Fleet strategy: each survivor's signals (parallel to survivors), and the
    # targets eliminated because the model would not fit in memory.
    fleet_scores: Sequence[FleetScore] = ()
    no_memory: Sequence[tuple[PreparedTarget, FleetScore]] = ()

    @cached_property
    def outcome(self) -> Outcome:
        """What trying this model came to."""
        if self.routes is None or not self.routes.is_served:
            # Only disabled or vanished rows list it: nobody serves it.
            return Outcome.NOT_FOUND
        if self.survivors:
            return Outcome.ROUTED
        if self.missing_capabilities:
            return Outcome.CAPABILITY_MISMATCH
        return Outcome.NO_HEALTHY_BACKEND

    @cached_property
    def missing_capabilities(self) -> tuple[str, ...]:
        """Capabilities no backend of this model can offer the request.

        Empty when some backend has them all (whatever its health: it may come
        back). When each capability exists somewhere but no one backend has all
        of them, every capability some backend lacks is listed. Rows an operator
        switched off (backend or model disabled) do not count: they will not
        serve the request later either, so it is the client's to change (400).
        """
        if self.routes is None:
            return ()
        lacking = [
            t.capability_reasons(self.requirements) for t in self._switched_on_targets
        ]
        if not lacking or any(not reasons for reasons in lacking):
            return ()
        common = set(lacking[0]).intersection(*lacking[1:])
        chosen = common or set().union(*lacking)
        return tuple(
            name for reason, name in CAPABILITY_NAMES.items() if reason in chosen
        )

    @property
    def _switched_on_targets(self) -> list[Target]:
        routes = self.routes
        if routes is None:
            return []
        return [t for t in routes.targets if t.backend.enabled and t.model.enabled]

    @cached_property
    def largest_context(self) -> int | None:
        """The longest known context among this model's backends."""
        if self.routes is None:
            return None
        lengths = [t.model.context_length for t in self._switched_on_targets]
        known = [n for n in lengths if n is not None]
        return max(known) if known and len(known) == len(lengths) else None

    @cached_property
    def candidates(self) -> tuple[Candidate, ...]:
        """Backends that passed every filter, with their score components."""
        fleet: Sequence[FleetScore | None] = self.fleet_scores or [None] * len(
            self.survivors
        )
        return tuple(
            Candidate(
                target=prepared.target,
                in_flight=in_flight,
                latency_ms=latency_ms,
                score=score_backend(
                    prepared.priority, in_flight, latency_ms, self.weights
                ),
                fleet=signals,
            )
            for prepared, in_flight, latency_ms, signals in zip(
                self.survivors, self.in_flight, self.latencies, fleet, strict=True
            )
        )

    @cached_property
    def excluded(self) -> tuple[Exclusion, ...]:
        """Backends listing this model that were not candidates, in stable order."""
        if self.routes is None:
            return ()
        in_flight = {p.position: n for p, n in self.rejected}
        passed = {prepared.position for prepared in self.survivors}
        deferred = {prepared.position for prepared in self.unconfirmed}
        short = {prepared.position: score for prepared, score in self.no_memory}
        exclusions = []
        for position, target in enumerate(self.routes.targets):
            if position in passed:
                continue
            reasons = target.static_reasons() + target.capability_reasons(
                self.requirements
            )
            pending = in_flight.get(position)
            if pending is not None and pending >= target.backend.capacity:
                reasons += (Reason.AT_CAPACITY,)
            if target.backend.name in self.circuit_open:
                reasons += (Reason.CIRCUIT_OPEN,)
            if target.backend.name in self.error_cached:
                reasons += (Reason.ERROR_CACHED,)
            if position in deferred:
                reasons += (Reason.CAPABILITY_UNCONFIRMED,)
            score = short.get(position)
            if score is not None:
                reasons += (
                    (Reason.COLD_LOADS_PAUSED,) if score.paused else (Reason.NO_MEMORY,)
                )
            exclusions.append(
                Exclusion(
                    target=target,
                    reasons=reasons,
                    detail=_describe(
                        reasons, target, self.requirements, pending, score
                    ),
                )
            )
        return tuple(exclusions)

    def ordered_targets(self, strategy: Strategy, chosen: int | None) -> list[Target]:
        """Every candidate in the order to try it, then the unconfirmed ones.

        ``chosen`` is the index the strategy picked; None picks as the strategy
        would without taking a turn (smart, fleet: the best score; otherwise the
        first in stable order, by priority for priority_only).
        """
        survivors = self.survivors
        targets: list[Target] = []
        if survivors:
            priorities = [prepared.priority for prepared in survivors]
            if chosen is None:
                if self.totals:
                    chosen = pick_smart(self.totals)
                else:
                    chosen = priorities.index(min(priorities))
            order = order_retries(
                strategy, chosen, totals=self.totals, priorities=priorities
            )
            targets = [survivors[i].target for i in (chosen, *order)]
        targets.extend(prepared.target for prepared in self.unconfirmed)
        return targets

    def summarize_exclusions(self) -> str:
        """Count excluded backends by their first reason: '2 unhealthy, 1 draining'."""
        counts = Counter(e.reasons[0] for e in self.excluded if e.reasons)
        return ", ".join(
            f"{count} {_SUMMARY_PHRASES[reason]}"
            for reason, count in sorted(counts.items(), key=lambda kv: -kv[1])
        )

    def as_dict(self) -> AttemptDict:
        """Return the JSON shape."""
        return {
            "model": self.model,
            "role": str(self.role),
            "outcome": str(self.outcome),
            "candidates": [c.as_dict() for c in self.candidates],
            "excluded": [e.as_dict() for e in self.excluded],
        }


@dataclass(eq=False)
class Decision:
    """Where a request goes (or why it cannot go anywhere), and how that was decided.

    ``attempts`` lists every model tried in order: the requested one, then its
    alias target, then fallbacks. On success ``chosen`` is set, ``onward``
    holds the fallback chain's models after the served one (tried when every
    backend of the served model fails before answering), and ``retry_order``
    holds the other candidates of the served model, then those of the onward
    models, in the order to retry them; on failure ``error`` is set.
    """

    requirements: RequestRequirements
    strategy: Strategy
    snapshot_version: int
    max_retries: int
    attempts: tuple[Attempt, ...]
    chosen_index: int | None = None
    via: Via | None = None
    error: RoutingError | None = None
    onward: tuple[Attempt, ...] = ()
    # The pattern alias (``claude-*``) the requested name resolved through.
    alias_pattern: str | None = None
    # What prefix routing made of it (None: off, or no prompt to match).
    prefix: PrefixChoice | None = None
    # The split side the request was put on (None: the name is no split);
    # ``requirements.model`` is then the side's model.
    split: SplitChoice | None = None

    @property
    def requested_model(self) -> str:
        """The model name the client asked for (a split's name, not its side)."""
        if self.split is not None:
            return self.split.split
        return self.requirements.model

    @property
    def served(self) -> Attempt | None:
        """The attempt whose model serves the request, if any did."""
        if self.chosen_index is None:
            return None
        return self.attempts[-1]

    @property
    def resolved_model(self) -> str | None:
        """The model name the chosen backend will run."""
        served = self.served
        return served.model if served is not None else None

    @property
    def chosen(self) -> Target | None:
        """The backend and model picked, or None if routing failed."""
        served = self.served
        if served is None or self.chosen_index is None:
            return None
        return served.survivors[self.chosen_index].target

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """The served model's candidates with score components."""
        served = self.served
        return served.candidates if served is not None else ()

    @property
    def excluded(self) -> tuple[Exclusion, ...]:
        """Every exclusion across every model tried."""
        return tuple(e for attempt in self.attempts for e in attempt.excluded)

    @cached_property
    def retry_order(self) -> tuple[Target, ...]:
        """Every other candidate in the order to retry it, across fallbacks.

        The served model's other candidates come first, then each onward
        fallback model's, without a limit; ``retry_targets`` applies it.
        """
        return tuple(t for part in self._retry_parts() for t in part)

    @cached_property
    def retry_targets(self) -> tuple[Target, ...]:
        """What the proxy tries after the chosen backend fails before answering.

        At most ``max_retries`` other backends of the served model, then each
        onward fallback model's best backend and up to ``max_retries`` more.
        """
        parts = self._retry_parts()
        if not parts:
            return ()
        bounded = list(parts[0][: self.max_retries])
        for part in parts[1:]:
            bounded.extend(part[: self.max_retries + 1])
        return tuple(bounded)

    def _retry_parts(self) -> list[list[Target]]:
        served = self.served
        if served is None or self.chosen_index is None:
            return []
        parts = [served.ordered_targets(self.strategy, self.chosen_index)[1:]]
        parts.extend(a.ordered_targets(self.strategy, None) for a in self.onward)
        return parts

    def summary(self, limit: int = 8) -> dict[str, object]:
        """A compact, bounded description to keep with the request's usage.

        The chosen backend, at most `limit` candidates with their scores and
        `limit` exclusions with their reasons, the split side and the prefix
        signal: what explaining a past request shows.
        """
        chosen = self.chosen
        return {
            "requested_model": self.requested_model,
            "resolved_model": self.resolved_model,
            "via": str(self.via) if self.via is not None else None,
            "strategy": str(self.strategy),
            "snapshot_version": self.snapshot_version,
            "chosen": _target_dict(chosen) if chosen is not None else None,
            "candidates": [
                {
                    "backend": c.target.backend.name,
                    "model": c.target.model.name,
                    "in_flight": c.in_flight,
                    "latency_ms": _round(c.latency_ms),
                    "score": round(c.score.total, 2),
                }
                for c in self.candidates[:limit]
            ],
            "excluded": [
                {
                    "backend": e.target.backend.name,
                    "model": e.target.model.name,
                    "reasons": [str(r) for r in e.reasons],
                }
                for e in self.excluded[:limit]
            ],
            "retry_order": [t.backend.name for t in self.retry_targets[:limit]],
            "split": self.split.as_dict() if self.split is not None else None,
            "prefix": self.prefix.reason() if self.prefix is not None else None,
        }

    def as_dict(self) -> DecisionDict:
        """Return a JSON-serialisable description of the decision."""
        chosen = self.chosen
        error: ErrorDict | None = None
        if self.error is not None:
            body = self.error.to_openai()["error"]
            error = {"status": self.error.status, **body}
        req = self.requirements
        return {
            "requested_model": self.requested_model,
            "resolved_model": self.resolved_model,
            "via": str(self.via) if self.via is not None else None,
            "alias_pattern": self.alias_pattern,
            "strategy": str(self.strategy),
            "snapshot_version": self.snapshot_version,
            "requirements": {
                "model": req.model,
                "estimated_tokens": req.estimated_tokens,
                "needs_vision": req.needs_vision,
                "needs_tools": req.needs_tools,
                "needs_json_mode": req.needs_json_mode,
            },
            "chosen": _target_dict(chosen) if chosen is not None else None,
            "retry_order": [_target_dict(t) for t in self.retry_order],
            "candidates": [c.as_dict() for c in self.candidates],
            "excluded": [e.as_dict() for e in self.excluded],
            "attempts": [a.as_dict() for a in self.attempts],
            "onward": [a.as_dict() for a in self.onward],
            "error": error,
            "prefix": self.prefix.as_dict() if self.prefix is not None else None,
            "split": self.split.as_dict() if self.split is not None else None,
        }


def fleet_signals_dict(score: FleetScore) -> FleetSignalsDict:
    """Each of the fleet strategy's seven signals: its raw value and its points."""
    return {
        "thermal": {"value": str(score.thermal), "points": score.thermal_points},
        "memory_fit": {
            "value": _round(score.fit_ratio),
            "points": score.fit_points,
            "limit_gb": _round(score.memory_limit_gb),
            "source": score.memory_source or None,
        },
        "queue_depth": {"value": score.depth, "points": _penalty(score.queue_points)},
        "estimated_wait": {
            "value": round(score.est_wait_s, 2),
            "source": (
                "p75"
                if score.wait_from_samples
                else "heuristic"
                if score.bandwidth_gbps is None
                else "bandwidth"
            ),
            "bandwidth_gbps": _round(score.bandwidth_gbps),
            "load_s": round(score.load_s, 2),
            "points": _penalty(round(score.wait_points, 2)),
        },
        "role_affinity": {
            "value": {"parameters_b": score.parameters_b, "tier": score.tier or None},
            "points": score.affinity_points,
        },
        "trend": {"value": str(score.trend), "points": score.trend_points},
        "context_fit": {
            "value": {"window": score.context_window, "tokens": score.tokens},
            "points": score.context_points,
        },
        "total": round(score.total, 2),
    }


def capabilities_dict(target: Target) -> CapabilitiesDict:
    """The model's capabilities as "yes", "no" or "unknown"."""
    model = target.model
    return {
        "vision": _tri_state(model.supports_vision),
        "tools": _tri_state(model.supports_tools),
        "json_mode": _tri_state(model.supports_json_mode),
    }


def _tri_state(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def _target_dict(target: Target) -> TargetDict:
    return {"backend": target.backend.name, "model": target.model.name}


def _penalty(points: float) -> float:
    """Points taken away, as a negative number (0, not -0, for none)."""
    return -points if points else 0.0


def _gb(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _describe(
    reasons: tuple[Reason, ...],
    target: Target,
    requirements: RequestRequirements,
    in_flight: int | None,
    fleet: FleetScore | None = None,
) -> str:
    parts = []
    for reason in reasons:
        if reason is Reason.CONTEXT_TOO_SHORT:
            parts.append(
                f"context length {target.model.context_length} is below the "
                f"~{requirements.estimated_tokens} tokens estimated"
            )
        elif reason is Reason.NO_MEMORY:
            backend = target.backend
            ratio = None if fleet is None else fleet.fit_ratio
            limit = None if fleet is None else fleet.memory_limit_gb
            source = "" if fleet is None else fleet.memory_source
            size = target.model.memory_gb
            # What the fleet strategy counted (the probe, plus what this
            # process loaded or expects unloaded since), not only the probe.
            used = (
                backend.memory_used_gb
                if ratio is None or size is None or limit is None
                else limit - ratio * size
            )
            parts.append(
                "not loaded, and it does not fit in memory even once the idle "
                f"models are unloaded (fit ratio "
                f"{_gb(ratio)}: {_LIMIT_NAMES.get(source, 'ceiling')} "
                f"{_gb(limit)} GB, {_gb(used)} GB in use, model "
                f"{_gb(target.model.memory_gb)} GB)"
            )
        elif reason is Reason.COLD_LOADS_PAUSED:
            why = "" if fleet is None else fleet.paused
            parts.append(f"not loaded, and the node is paused for cold loads: {why}")
        elif reason is Reason.AT_CAPACITY:
            parts.append(
                f"at max concurrency ({in_flight}/{target.backend.max_concurrency} "
                "in flight)"
            )
        else:
            parts.append(_DETAILS[reason])
    return "; ".join(parts)


# How each source of the memory limit reads in an exclusion's detail.
_LIMIT_NAMES = {
    "ceiling": "ceiling",
    "reported": "memory reported",
    "oom": "memory learned from an out-of-memory error",
}

_DETAILS: dict[Reason, str] = {
    Reason.BACKEND_DISABLED: "backend disabled",
    Reason.MODEL_DISABLED: "model disabled on this backend",
    Reason.UNHEALTHY: "backend unhealthy",
    Reason.DRAINING: "backend draining",
    Reason.HEALTH_UNKNOWN: "backend not yet health-checked (health unknown)",
    Reason.HEALTH_STALE: (
        "last health check too old (over 3 health intervals): health unknown "
        "until the next check; is Celery beat running?"
    ),
    Reason.NO_VISION: "model does not support vision",
    Reason.NO_TOOLS: "model does not support tools",
    Reason.NO_JSON_MODE: "model does not support JSON mode",
    Reason.CAPABILITY_UNCONFIRMED: (
        "capability support unknown; tried after backends that confirm it"
    ),
    Reason.CIRCUIT_OPEN: (
        "circuit breaker open: the gateway saw repeated failures and pauses "
        "traffic for a cool-down"
    ),
    Reason.ERROR_CACHED: (
        "a connection to it failed moments ago (error cache): new requests go "
        "elsewhere until it may be tried again"
    ),
}
