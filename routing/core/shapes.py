"""JSON shapes of a decision record (``nexus_route --explain``, the explain API)."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class TargetDict(TypedDict):
    """A backend and the model it would run."""

    backend: str
    model: str


class ScoreDict(TypedDict):
    """The smart score and its three 0..100 components."""

    priority: float
    load: float
    latency: float
    total: float


class CapabilitiesDict(TypedDict):
    """A model's capabilities: "yes", "no" or "unknown" (the backend decides)."""

    vision: str
    tools: str
    json_mode: str


class SignalDict(TypedDict):
    """One fleet signal: what was read and the points it gave (penalties < 0)."""

    value: Any
    points: float


class WaitSignalDict(SignalDict):
    """The estimated wait, and where it came from: "p75" (timed answers),
    "bandwidth" (a guess at the node's learned memory bandwidth,
    ``bandwidth_gbps``) or "heuristic" (a guess at the default bandwidth)."""

    source: str
    bandwidth_gbps: float | None
    # Seconds to load the model first, at the node's learned load rate (0:
    # hot, or no load timed there yet); part of the value.
    load_s: float


class MemorySignalDict(SignalDict):
    """The memory fit, with the limit it was read against and its source:
    "ceiling" (the operator's), "reported" (by the node), "oom" (its last
    out-of-memory error) or None (unknown)."""

    limit_gb: float | None
    source: str | None


class FleetSignalsDict(TypedDict):
    """The fleet strategy's seven signals of one candidate, and their total."""

    thermal: SignalDict
    memory_fit: MemorySignalDict
    queue_depth: SignalDict
    estimated_wait: WaitSignalDict
    role_affinity: SignalDict
    trend: SignalDict
    context_fit: SignalDict
    total: float


class CandidateDict(TypedDict):
    """A backend that passed every filter."""

    backend: str
    model: str
    priority: int
    in_flight: int
    max_concurrency: int | None
    latency_ms: float | None
    capabilities: CapabilitiesDict
    score: ScoreDict
    fleet: NotRequired[FleetSignalsDict]


class ExclusionDict(TypedDict):
    """A backend that did not, with machine and human reasons."""

    backend: str
    model: str
    reasons: list[str]
    detail: str
    capabilities: CapabilitiesDict


class AttemptDict(TypedDict):
    """One model tried: requested, alias target or fallback."""

    model: str
    role: str
    outcome: str
    candidates: list[CandidateDict]
    excluded: list[ExclusionDict]


class RequirementsDict(TypedDict):
    """What the request needs."""

    model: str
    estimated_tokens: int
    needs_vision: bool
    needs_tools: bool
    needs_json_mode: bool


class ErrorDict(TypedDict):
    """The routing error: HTTP status plus the OpenAI error fields."""

    status: int
    message: str
    type: str
    param: str | None
    code: str | None


class DecisionDict(TypedDict):
    """A whole decision, as ``Decision.as_dict()`` returns it."""

    requested_model: str
    resolved_model: str | None
    via: str | None
    # The pattern alias the requested name matched, when it matched one.
    alias_pattern: str | None
    strategy: str
    snapshot_version: int
    requirements: RequirementsDict
    chosen: TargetDict | None
    retry_order: list[TargetDict]
    candidates: list[CandidateDict]
    excluded: list[ExclusionDict]
    attempts: list[AttemptDict]
    # Fallback models after the served one, tried when all its backends fail.
    onward: list[AttemptDict]
    error: ErrorDict | None
    # Prefix-aware routing's signal and matched length (None when off).
    prefix: NotRequired[dict[str, Any] | None]
    split: NotRequired[dict[str, object] | None]
