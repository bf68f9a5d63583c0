"""Immutable data the router decides over: backends, their models, the snapshot.

``routing/snapshot.py`` fills these from the ORM (field names follow
``backends.models.Backend`` / ``BackendModel`` and ``routing.models``); tests
and benchmarks build them directly. Nothing here changes after construction, so
a snapshot can be shared by every request, thread and task of a process and
replaced by assigning a new one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from routing.core.aliases import AliasPatterns, check_alias_pattern, is_alias_pattern
from routing.core.policy import Policy
from routing.core.requirements import RequestRequirements
from routing.core.scoring import score_priority
from routing.core.traffic import Split
from routing.core.vocabulary import JSON_MODE, TOOLS, VISION, Health, Reason

# Stands in for "no limit" so that the hot loop compares plain integers.
UNLIMITED = sys.maxsize


_HEALTH_REASONS: dict[str, Reason] = {
    Health.UNKNOWN: Reason.HEALTH_UNKNOWN,
    Health.UNHEALTHY: Reason.UNHEALTHY,
    Health.DRAINING: Reason.DRAINING,
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model one backend serves, with the capabilities the router filters on.

    ``context_length`` of None means unknown, and no limit is applied. Each
    capability is tri-state: True (yes), False (no: requests needing it are
    not sent here) or None (unknown: the backend decides; a backend saying
    yes is preferred).
    """

    name: str
    context_length: int | None = None
    supports_vision: bool | None = None
    supports_tools: bool | None = None
    supports_json_mode: bool | None = None
    loaded: bool = False
    enabled: bool = True
    # What the fleet strategy reads (None: unknown). Sizes are in GB; times are
    # wall-clock epoch seconds. ``vram_gb`` is what the loaded model occupies,
    # ``loaded_context`` the context window it was loaded with, ``expires_at``
    # when the backend unloads it (Ollama's keep_alive), ``last_loaded_at`` when
    # it was last seen loaded. ``listed``: the backend's own list has it (on
    # disk), not only the operator.
    size_gb: float | None = None
    vram_gb: float | None = None
    loaded_context: int | None = None
    expires_at: float | None = None
    last_loaded_at: float | None = None
    parameters_b: float | None = None
    listed: bool = True
    max_concurrency: int | None = None
    # Bytes of KV cache one token of context takes (from the model's
    # architecture: Ollama's /api/show); None: unknown.
    kv_bytes_per_token: int | None = None

    @property
    def memory_gb(self) -> float | None:
        """What the model takes in memory when loaded (its size on disk if unseen)."""
        return self.vram_gb if self.vram_gb is not None else self.size_gb

    @property
    def capability_mask(self) -> int:
        """The capabilities confirmed, as VISION | TOOLS | JSON_MODE bits."""
        return (
            (VISION if self.supports_vision else 0)
            | (TOOLS if self.supports_tools else 0)
            | (JSON_MODE if self.supports_json_mode else 0)
        )

    @property
    def refused_mask(self) -> int:
        """The capabilities explicitly not offered (False, not unknown)."""
        return (
            (VISION if self.supports_vision is False else 0)
            | (TOOLS if self.supports_tools is False else 0)
            | (JSON_MODE if self.supports_json_mode is False else 0)
        )

    @property
    def context_limit(self) -> int:
        """The context length, or UNLIMITED when it is unknown."""
        return UNLIMITED if self.context_length is None else self.context_length


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A backend and the connection details the proxy needs to reach it.

    ``status`` takes the stored strings and becomes a Health; anything
    unrecognised counts as unknown (and so is not routed to). ``health_stale``
    marks a backend whose last health result was too old: its status is then
    unknown. ``api_key`` is kept out of repr.
    """

    name: str
    base_url: str
    kind: str = "openai"
    api_key: str = field(default="", repr=False)
    enabled: bool = True
    priority: int = 10
    max_concurrency: int | None = None
    request_timeout: float = 300.0
    status: str = Health.UNKNOWN
    avg_latency_ms: float | None = None
    models: tuple[ModelSpec, ...] = ()
    id: int | None = None
    health_stale: bool = False
    # The fleet strategy's: memory it may fill (GB; the operator's override of
    # what the node reports) and its size class ("large", "medium", "small";
    # "" when the operator did not say).
    memory_ceiling_gb: float | None = None
    tier: str = ""
    # Prompt tokens its prompt cache holds per model (prefix-aware routing;
    # None: the policy's cache_blocks).
    prefix_cache_tokens: int | None = None
    # What the node itself last reported (a health probe, or a relay worker's
    # report; None: it did not say). ``memory_total_gb``: the memory models may
    # fill there; ``memory_reported_used_gb``: what its loaded models take,
    # listed here or not (Ollama's /api/ps size_vram sum);
    # ``memory_pressure``: it says it is short of memory (vLLM's KV cache
    # nearly full), so no new model is loaded there; ``slots``: requests it
    # runs at once (llama.cpp's total_slots); ``memory_reported_at``: when
    # (wall clock, epoch seconds).
    memory_total_gb: float | None = None
    memory_reported_used_gb: float | None = None
    memory_pressure: bool = False
    slots: int | None = None
    memory_reported_at: float | None = None
    # Computed: memory its loaded models take (GB); None when a size is unknown.
    memory_used_gb: float | None = field(default=None, init=False, compare=False)
    # Computed: memory the node reported in use beyond the models listed here
    # as loaded (models Nexus does not route to, other programs); 0 unknown.
    memory_other_gb: float = field(default=0.0, init=False, compare=False)
    # Computed: the models the last probe saw loaded, and every model by name
    # (the fleet strategy looks these up per decision).
    loaded_models: tuple[ModelSpec, ...] = field(
        default=(), init=False, compare=False, repr=False
    )
    models_by_name: Mapping[str, ModelSpec] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        try:
            status = Health(self.status)
        except ValueError:
            status = Health.UNKNOWN
        if self.health_stale:
            status = Health.UNKNOWN
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "models", tuple(self.models))
        used = _memory_used(self.models)
        object.__setattr__(self, "memory_used_gb", used)
        reported = self.memory_reported_used_gb
        if reported is not None and used is not None:
            object.__setattr__(self, "memory_other_gb", max(reported - used, 0.0))
        object.__setattr__(
            self, "loaded_models", tuple(m for m in self.models if m.loaded)
        )
        object.__setattr__(
            self, "models_by_name", {m.name: m for m in reversed(self.models)}
        )
        latency = self.avg_latency_ms
        if latency is not None and (math.isnan(latency) or latency < 0):
            object.__setattr__(self, "avg_latency_ms", None)

    @property
    def memory_limit_gb(self) -> float | None:
        """The memory models may fill: the operator's ceiling, else what the
        node reported (None: neither)."""
        if self.memory_ceiling_gb is not None:
            return self.memory_ceiling_gb
        return self.memory_total_gb

    @property
    def capacity(self) -> int:
        """Requests this backend may have in flight (UNLIMITED when unset)."""
        if self.max_concurrency is None or self.max_concurrency < 1:
            return UNLIMITED
        return self.max_concurrency


@dataclass(frozen=True, slots=True)
class Target:
    """One place a request can go: a backend and the model it would run there."""

    backend: BackendSpec
    model: ModelSpec

    @property
    def backend_name(self) -> str:
        """The backend's name (unique within a snapshot)."""
        return self.backend.name

    @property
    def model_name(self) -> str:
        """The model name to send upstream."""
        return self.model.name

    def static_reasons(self) -> tuple[Reason, ...]:
        """Reasons that exclude this target whatever the request (health, flags)."""
        reasons: list[Reason] = []
        if not self.backend.enabled:
            reasons.append(Reason.BACKEND_DISABLED)
        if not self.model.enabled:
            reasons.append(Reason.MODEL_DISABLED)
        health_reason = _HEALTH_REASONS.get(self.backend.status)
        if self.backend.health_stale:
            reasons.append(Reason.HEALTH_STALE)
        elif health_reason is not None:
            reasons.append(health_reason)
        return tuple(reasons)

    def capability_reasons(
        self, requirements: RequestRequirements
    ) -> tuple[Reason, ...]:
        """Return what this model lacks for `requirements` (empty if nothing).

        Only an explicit "no" counts as lacking; an unknown capability does not.
        """
        model = self.model
        reasons: list[Reason] = []
        if requirements.needs_vision and model.supports_vision is False:
            reasons.append(Reason.NO_VISION)
        if requirements.needs_tools and model.supports_tools is False:
            reasons.append(Reason.NO_TOOLS)
        if requirements.needs_json_mode and model.supports_json_mode is False:
            reasons.append(Reason.NO_JSON_MODE)
        if model.context_limit < requirements.estimated_tokens:
            reasons.append(Reason.CONTEXT_TOO_SHORT)
        return tuple(reasons)


class PreparedTarget(NamedTuple):
    """A routable target with what the hot loop reads, computed once per snapshot."""

    target: Target
    backend_name: str
    capability_mask: int  # confirmed capabilities
    refused_mask: int  # capabilities explicitly not offered
    context_limit: int
    capacity: int
    priority: int
    priority_points: float  # score_priority(priority) * priority weight
    avg_latency_ms: float | None
    position: int  # index in ModelRoutes.targets


@dataclass(frozen=True, slots=True)
class ModelRoutes:
    """Every target of one model name, and the routable ones prepared for speed.

    ``targets`` is in stable order (backend priority, then name); ``routable``
    holds the enabled, healthy ones, and ``backend_names`` their names.
    ``common_mask`` (capabilities every routable target confirms) and
    ``min_context`` cover all routable targets, so a request needing no more
    than that skips the per-target capability checks;
    without ``has_capacity_limits`` the concurrency check is skipped too.
    """

    model: str
    targets: tuple[Target, ...]
    routable: tuple[PreparedTarget, ...]
    backend_names: tuple[str, ...]
    common_mask: int
    min_context: int
    has_capacity_limits: bool
    # Some enabled backend lists the model enabled (healthy or not): without
    # one, the model is not served at all (404), not merely down (503).
    is_served: bool = True


@dataclass(frozen=True, eq=False)
class RouterSnapshot:
    """Everything the router reads, frozen at one configuration version.

    Build it with ``RouterSnapshot.build()``. Lookups by model name are O(1) in
    the number of models.
    """

    version: int
    backends: tuple[BackendSpec, ...]
    aliases: Mapping[str, str]
    fallbacks: Mapping[str, tuple[str, ...]]
    policy: Policy
    routes: Mapping[str, ModelRoutes] = field(repr=False)
    backends_by_name: Mapping[str, BackendSpec] = field(repr=False)
    alias_problems: tuple[str, ...] = ()
    # Aliases whose name is a glob (``claude-*``), tried after exact names and
    # exact aliases; ``aliases`` holds only the exact ones.
    alias_patterns: AliasPatterns = field(default_factory=AliasPatterns, repr=False)
    # Wall-clock time (epoch seconds) when some backend's health result goes
    # stale and the snapshot must be rebuilt to stop routing there; None: never.
    expires_at: float | None = None
    # Client-facing names shared over several models (routing.core.traffic).
    splits: Mapping[str, Split] = field(
        default_factory=lambda: MappingProxyType({}), repr=False
    )

    @classmethod
    def build(
        cls,
        *,
        version: int = 0,
        backends: Iterable[BackendSpec] = (),
        aliases: Mapping[str, str] | None = None,
        fallbacks: Mapping[str, Sequence[str]] | None = None,
        policy: Policy | None = None,
        expires_at: float | None = None,
        splits: Iterable[Split] = (),
    ) -> RouterSnapshot:
        """Index plain routing data into a snapshot.

        Backends are ordered by (priority, name), which is the stable order
        every strategy's tie-break uses. Alias entries that point at themselves
        are dropped and aliases that point at other aliases are kept but
        reported in ``alias_problems`` (the router never follows a second
        level). Empty fallback chains are dropped, as are duplicate steps and
        steps naming the chain's own model. A step naming an alias is resolved
        as a requested model would be, one level: to the alias's target (after
        the alias name itself, when some backend also serves that name), or
        by a pattern alias when no backend serves it. An alias whose name has
        ``*`` or ``?`` is a pattern (``alias_patterns``); an invalid one, or one
        targeting a pattern, is left out and reported in ``alias_problems``.
        Raises ValueError on duplicate backend names or a model listed twice
        on one backend.
        """
        policy = policy or Policy()
        ordered = tuple(sorted(backends, key=lambda b: (b.priority, b.name)))
        by_name: dict[str, BackendSpec] = {}
        for backend in ordered:
            if backend.name in by_name:
                raise ValueError(f"Duplicate backend name {backend.name!r}")
            by_name[backend.name] = backend

        targets_by_model: dict[str, list[Target]] = {}
        for backend in ordered:
            seen: set[str] = set()
            for model in backend.models:
                if model.name in seen:
                    raise ValueError(
                        f"Model {model.name!r} is listed twice on {backend.name!r}"
                    )
                seen.add(model.name)
                targets_by_model.setdefault(model.name, []).append(
                    Target(backend=backend, model=model)
                )

        weight = policy.weights.priority
        routes = {
            name: _index_model(name, tuple(targets), weight)
            for name, targets in targets_by_model.items()
        }
        clean_aliases: dict[str, str] = {}
        patterns: dict[str, str] = {}
        problems: list[str] = []
        for alias, raw_target in (aliases or {}).items():
            target = raw_target.strip()
            if not target or target == alias:
                continue
            if not is_alias_pattern(alias):
                clean_aliases[alias] = target
            elif (why := check_alias_pattern(alias)) is not None:
                problems.append(f"Alias pattern {alias!r} is ignored: {why}")
            elif is_alias_pattern(target):
                problems.append(
                    f"Alias pattern {alias!r} is ignored: its target {target!r} "
                    "must be a model name, not a pattern."
                )
            else:
                patterns[alias] = target
        problems += (
            f"Alias {alias!r} points to {target!r}, which is itself an alias "
            f"for {clean_aliases[target]!r}; aliases are single-level, so "
            f"{alias!r} only reaches backends serving {target!r} directly"
            for alias, target in sorted({**clean_aliases, **patterns}.items())
            if target in clean_aliases
        )
        alias_patterns = AliasPatterns(patterns)
        return cls(
            version=version,
            backends=ordered,
            aliases=MappingProxyType(clean_aliases),
            fallbacks=MappingProxyType(
                _resolve_steps(
                    _clean_fallbacks(fallbacks or {}),
                    clean_aliases,
                    alias_patterns,
                    routes,
                )
            ),
            policy=policy,
            routes=MappingProxyType(routes),
            backends_by_name=MappingProxyType(by_name),
            alias_problems=tuple(problems),
            alias_patterns=alias_patterns,
            expires_at=expires_at,
            splits=MappingProxyType({split.name: split for split in splits}),
        )

    def backend(self, name: str) -> BackendSpec | None:
        """Return the backend called `name`, if any."""
        return self.backends_by_name.get(name)

    def alias_for(self, name: str) -> str | None:
        """The model `name` is an alias for, exact or by pattern; None if neither.

        An exact alias wins; a pattern covers only names that no enabled
        backend serves, longest pattern first.
        """
        target = self.aliases.get(name)
        if target is not None or not self.alias_patterns:
            return target
        found = self._pattern_match(name)
        return None if found is None else found[1]

    def alias_pattern_for(self, name: str) -> str | None:
        """The pattern alias that `name` resolves through, if it does."""
        if name in self.aliases or not self.alias_patterns:
            return None
        found = self._pattern_match(name)
        return None if found is None else found[0]

    def models_for(self, name: str) -> tuple[str, ...]:
        """The models a request for `name` may be served by, in the router's
        order: the name, its alias target, then the fallback chains'.

        `name` may be a pattern alias itself (``claude-*``): then its target
        and its chains, as for any name it covers. For a split: each side's
        models, the sides in their order.
        """
        split = self.splits.get(name)
        if split is not None:
            found = (m for side in split.sides for m in self.models_for(side.model))
            return tuple(dict.fromkeys(found))
        target = self.alias_patterns.targets.get(name)
        if target is not None:
            return (target, *self.fallbacks_for(name, target))
        target = self.alias_for(name)
        if target is None:
            return (name, *self.fallbacks_for(name))
        pattern = None if name in self.aliases else self.alias_pattern_for(name)
        keys = (name, target) if pattern is None else (name, pattern, target)
        return (name, target, *self.fallbacks_for(*keys))

    def _pattern_match(self, name: str) -> tuple[str, str] | None:
        routes = self.routes.get(name)
        if routes is not None and routes.is_served:
            return None
        return self.alias_patterns.match(name)

    def targets_for(self, model: str) -> tuple[Target, ...]:
        """Every backend listing `model` (routable or not), in stable order."""
        routes = self.routes.get(model)
        return routes.targets if routes is not None else ()

    def served_models(self) -> tuple[str, ...]:
        """Model names with at least one enabled entry on an enabled backend."""
        return tuple(
            sorted(name for name, routes in self.routes.items() if routes.is_served)
        )

    def fallbacks_for(self, *models: str) -> tuple[str, ...]:
        """The fallback models of `models`' chains in order, without repeats.

        Models in `models` themselves are left out: they are tried before any
        fallback.
        """
        chain: list[str] = []
        for model in models:
            for step in self.fallbacks.get(model, ()):
                if step not in chain and step not in models:
                    chain.append(step)
        return tuple(chain)


def _memory_used(models: Iterable[ModelSpec]) -> float | None:
    used = 0.0
    for model in models:
        if model.loaded:
            size = model.memory_gb
            if size is None:
                return None
            used += size
    return used


def _index_model(
    name: str, targets: tuple[Target, ...], priority_weight: int
) -> ModelRoutes:
    routable = tuple(
        PreparedTarget(
            target=target,
            backend_name=target.backend.name,
            capability_mask=target.model.capability_mask,
            refused_mask=target.model.refused_mask,
            context_limit=target.model.context_limit,
            capacity=target.backend.capacity,
            priority=target.backend.priority,
            priority_points=score_priority(target.backend.priority) * priority_weight,
            avg_latency_ms=target.backend.avg_latency_ms,
            position=position,
        )
        for position, target in enumerate(targets)
        if not target.static_reasons()
    )
    common_mask = VISION | TOOLS | JSON_MODE
    min_context = UNLIMITED
    for prepared in routable:
        common_mask &= prepared.capability_mask
        min_context = min(min_context, prepared.context_limit)
    return ModelRoutes(
        model=name,
        targets=targets,
        routable=routable,
        backend_names=tuple(p.backend_name for p in routable),
        common_mask=common_mask,
        min_context=min_context,
        has_capacity_limits=any(p.capacity != UNLIMITED for p in routable),
        is_served=any(t.backend.enabled and t.model.enabled for t in targets),
    )


def _resolve_steps(
    fallbacks: Mapping[str, tuple[str, ...]],
    aliases: Mapping[str, str],
    patterns: AliasPatterns,
    routes: Mapping[str, ModelRoutes],
) -> dict[str, tuple[str, ...]]:
    resolved: dict[str, tuple[str, ...]] = {}
    for model, steps in fallbacks.items():
        chain: list[str] = []
        for step in steps:
            target = aliases.get(step)
            served = step in routes and routes[step].is_served
            if target is None and patterns and not served:
                found = patterns.match(step)
                target = None if found is None else found[1]
            names = [step] if target is None or step in routes else []
            if target is not None:
                names.append(target)
            chain.extend(n for n in names if n != model and n not in chain)
        if chain:
            resolved[model] = tuple(chain)
    return resolved


def _clean_fallbacks(
    fallbacks: Mapping[str, Sequence[str]],
) -> dict[str, tuple[str, ...]]:
    cleaned: dict[str, tuple[str, ...]] = {}
    for model, steps in fallbacks.items():
        chain: list[str] = []
        for step in steps:
            step = step.strip()
            if step and step != model and step not in chain:
                chain.append(step)
        if chain:
            cleaned[model] = tuple(chain)
    return cleaned
