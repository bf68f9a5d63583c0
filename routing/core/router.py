"""Choose a backend for a request: filter, resolve aliases and fallbacks, pick.

The pipeline is the spec's:

1. candidates: every backend listing the requested model;
2. health: only enabled, healthy backends with the model enabled. Draining,
   unhealthy and *unknown* backends are excluded: a backend added a moment
   ago takes traffic once the health checker has seen it answer. A backend
   whose in-flight count has reached its max_concurrency is excluded too
   ("at_capacity"), as is one whose circuit breaker is open in the live
   stats ("circuit_open", see gateway.breaker), and one a connection to which
   failed moments ago ("error_cached", see gateway.error_cache) unless every
   backend left failed so: then the one that failed longest ago stays, so
   that a request is tried somewhere rather than refused untried;
3. capabilities: context length (when known) >= estimated tokens, and vision,
   tools and JSON mode when the request needs them. A capability is yes, no
   or unknown: only "no" excludes; when some candidates confirm every needed
   capability, those whose support is unknown are tried after them;
4. if no candidate is left: the model's alias target, through the same
   filters (one level: an alias of an alias is never followed). An exact
   alias first; else, for a name no enabled backend serves, the longest
   pattern alias covering it (``claude-*``), whose own fallback chain is
   tried after the name's;
5. then the fallback chain, each fallback through the same filters, one level
   (a fallback's own alias or chain is not consulted). The chain of the
   requested name is tried first, then the chain of its alias target;
6. the policy's strategy picks among the candidates of the first model that
   has any. The chain's models after that one are kept in the decision
   (``onward``): when every backend the proxy tries for the served model
   fails before answering, it continues with theirs (``retry_targets``).

When nothing is left, the error is the one that tells the client what would
make the request work, in this order of precedence:

- a fallback chain was tried: FallbackChainExhausted (503) listing every model
  attempted, unless no attempt failed for a passing reason (health, capacity)
  and one failed for capabilities; then the request itself must change:
  CapabilityMismatch (400);
- otherwise, if some backend could serve the request once healthy (or less
  busy): NoHealthyBackend (503), naming the model it was for;
- otherwise, if backends list the model but none has the capabilities:
  CapabilityMismatch (400) listing every missing capability;
- otherwise ModelNotFound (404); for an alias it names the alias and its target,
  and CircularAlias (a 404 too) says when the target is itself an alias.

Capability errors consider every backend of the model, healthy or not, so a
vision request whose only vision backend is down gets a 503 (retry later), not
a 400 (change the request).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import NamedTuple

from routing.core.decision import Attempt, Decision, Outcome, Role, Via
from routing.core.errors import (
    CapabilityMismatch,
    CircularAlias,
    FallbackChainExhausted,
    ModelNotFound,
    NoHealthyBackend,
    RoutingError,
)
from routing.core.fleet import FleetScore, score_fleet
from routing.core.prefix import PrefixChoice, PrefixRequest, choose_backend
from routing.core.requirements import RequestRequirements
from routing.core.stats import LiveStats
from routing.core.strategies import (
    RELAY_KIND,
    order_retries,
    pick_priority_only,
    pick_random,
    pick_rotating,
    pick_round_robin,
    pick_smart,
)
from routing.core.types import PreparedTarget, RouterSnapshot, Target
from routing.core.vocabulary import Strategy

_OUTCOME_WORDS = {
    Outcome.NOT_FOUND: "not found",
    Outcome.NO_HEALTHY_BACKEND: "no healthy backend",
    Outcome.CAPABILITY_MISMATCH: "capability mismatch",
}


class Route(NamedTuple):
    """The backend chosen for a request, and the decision behind it."""

    target: Target
    decision: Decision

    @property
    def retry_targets(self) -> tuple[Target, ...]:
        """Backends to try next if the chosen one fails (see Decision)."""
        return self.decision.retry_targets


class Router:
    """Routes requests over whichever snapshot it is given.

    Holds only the round-robin turn counters (one per served model, so that
    traffic for one model does not skew the rotation of another) and the
    random generator; the snapshot and live stats are passed in per call, so a
    snapshot swap needs nothing from the router. Safe to share between threads
    and tasks: taking a turn is ``next()`` on an ``itertools.count``, which is
    atomic in CPython, and scoring takes no lock.
    """

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()
        self._turns: dict[str, Iterator[int]] = {}
        self._last_turn: dict[str, int] = {}

    def select(
        self,
        requirements: RequestRequirements,
        snapshot: RouterSnapshot,
        stats: LiveStats,
        prefix: PrefixRequest | None = None,
        split_key: str = "",
    ) -> Route:
        """Choose a backend for the request.

        A split's name is first put on one of its sides (by `split_key`'s
        hash when the split is sticky per key; routing.core.traffic), then
        routed as that side's model. With `prefix` (and the policy's prefix routing on), a backend holding
        the prompt's prefix or the session may win over the strategy's choice
        (routing.core.prefix). Raises a RoutingError subclass (with
        ``.decision`` set) when no backend can take it; see the module
        docstring for which one.
        """
        decision = self._decide(
            requirements,
            snapshot,
            stats,
            take_turn=True,
            prefix=prefix,
            split_key=split_key,
        )
        if decision.error is not None:
            raise decision.error
        chosen = decision.chosen
        if chosen is None:  # unreachable: a decision without an error has a choice
            raise RuntimeError("The router produced neither a backend nor an error")
        return Route(target=chosen, decision=decision)

    def explain(
        self,
        requirements: RequestRequirements,
        snapshot: RouterSnapshot,
        stats: LiveStats,
        prefix: PrefixRequest | None = None,
        split_key: str = "",
    ) -> Decision:
        """Decide as select() would, without raising or advancing round-robin.

        A split still draws a side (per request, or by `split_key`'s hash).
        """
        return self._decide(
            requirements,
            snapshot,
            stats,
            take_turn=False,
            prefix=prefix,
            split_key=split_key,
        )

    def _decide(
        self,
        requirements: RequestRequirements,
        snapshot: RouterSnapshot,
        stats: LiveStats,
        *,
        take_turn: bool,
        prefix: PrefixRequest | None = None,
        split_key: str = "",
    ) -> Decision:
        split = snapshot.splits.get(requirements.model) if snapshot.splits else None
        if split is None:
            return self._decide_model(requirements, snapshot, stats, take_turn, prefix)
        choice = split.choose(split_key, self._rng)
        decision = self._decide_model(
            replace(requirements, model=choice.side),
            snapshot,
            stats,
            take_turn,
            prefix,
        )
        decision.split = choice
        return decision

    def _decide_model(
        self,
        requirements: RequestRequirements,
        snapshot: RouterSnapshot,
        stats: LiveStats,
        take_turn: bool,
        prefix: PrefixRequest | None,
    ) -> Decision:
        requested = requirements.model
        if prefix is not None and not snapshot.policy.prefix.enabled:
            prefix = None
        attempts: list[Attempt] = []

        attempt = self._try_model(
            requested, Role.REQUESTED, requirements, snapshot, stats
        )
        attempts.append(attempt)
        alias_target = snapshot.alias_for(requested)
        pattern = None
        if alias_target is None:
            tried: tuple[str, ...] = (requested,)
        elif requested in snapshot.aliases:
            tried = (requested, alias_target)
        else:
            # A pattern's own chain (keyed by the pattern) comes after the name's.
            pattern = snapshot.alias_pattern_for(requested)
            tried = (requested, alias_target)
            if pattern is not None and pattern in snapshot.fallbacks:
                tried = (requested, pattern, alias_target)
        chain = snapshot.fallbacks_for(*tried)
        if attempt.survivors:
            return self._choose(
                attempts,
                Via.DIRECT,
                requirements,
                snapshot,
                stats,
                chain,
                take_turn,
                prefix,
            )

        if alias_target is not None:
            attempt = self._try_model(
                alias_target, Role.ALIAS, requirements, snapshot, stats
            )
            attempts.append(attempt)
            if attempt.survivors:
                decision = self._choose(
                    attempts,
                    Via.ALIAS,
                    requirements,
                    snapshot,
                    stats,
                    chain,
                    take_turn,
                    prefix,
                )
                decision.alias_pattern = pattern
                return decision

        for position, fallback in enumerate(chain):
            attempt = self._try_model(
                fallback, Role.FALLBACK, requirements, snapshot, stats
            )
            attempts.append(attempt)
            if attempt.survivors:
                decision = self._choose(
                    attempts,
                    Via.FALLBACK,
                    requirements,
                    snapshot,
                    stats,
                    chain[position + 1 :],
                    take_turn,
                    prefix,
                )
                decision.alias_pattern = pattern
                return decision

        error = _explain_failure(attempts, alias_target, pattern, snapshot)
        decision = Decision(
            requirements=requirements,
            strategy=snapshot.policy.strategy,
            snapshot_version=snapshot.version,
            max_retries=snapshot.policy.max_retries,
            attempts=tuple(attempts),
            error=error,
            alias_pattern=pattern,
        )
        error.decision = decision
        return decision

    def _try_model(
        self,
        model: str,
        role: Role,
        requirements: RequestRequirements,
        snapshot: RouterSnapshot,
        stats: LiveStats,
    ) -> Attempt:
        policy = snapshot.policy
        routes = snapshot.routes.get(model)
        if routes is None:
            return Attempt(
                model=model,
                role=role,
                routes=None,
                requirements=requirements,
                weights=policy.weights,
            )
        # The hot path: it touches every backend of the model, so it works in
        # list comprehensions over precomputed per-snapshot sequences, and skips
        # the filters when no routable backend can fail them.
        in_flight_of = stats.in_flight_counts.get
        latency_of = stats.observed_latencies.get
        names: Sequence[str] = routes.backend_names
        survivors: Sequence[PreparedTarget] = routes.routable
        circuit_open: frozenset[str] = frozenset()
        if stats.open_circuits:
            # Rare: only while some backend's breaker is open anywhere.
            circuit_open = frozenset(
                name for name in names if stats.is_circuit_open(name)
            )
            if circuit_open:
                survivors = [p for p in survivors if p.backend_name not in circuit_open]
                names = [p.backend_name for p in survivors]
        pendings = [in_flight_of(name, 0) for name in names]
        rejected: list[tuple[PreparedTarget, int]] = []
        need = requirements.capability_mask
        tokens = requirements.estimated_tokens
        check_capabilities = bool(need & ~routes.common_mask) or (
            tokens > routes.min_context
        )
        # Under fleet a backend at max_concurrency stays a candidate: the queue
        # penalty scores it down, and the request waits for a slot there.
        limit_capacity = routes.has_capacity_limits and not policy.waits_at_backends
        if check_capabilities or limit_capacity:
            passed = [
                (not limit_capacity or pending < prepared.capacity)
                and not (
                    check_capabilities
                    and (
                        need & prepared.refused_mask or tokens > prepared.context_limit
                    )
                )
                for prepared, pending in zip(survivors, pendings, strict=True)
            ]
            if not all(passed):
                rejected = [
                    (prepared, pending)
                    for prepared, pending, ok in zip(
                        survivors, pendings, passed, strict=True
                    )
                    if not ok
                ]
                survivors = [p for p, ok in zip(survivors, passed, strict=True) if ok]
                pendings = [n for n, ok in zip(pendings, passed, strict=True) if ok]
                names = [p.backend_name for p in survivors]
        error_cached: frozenset[str] = frozenset()
        if stats.failed_connections and survivors:
            # Rare: only while a connection to some backend failed moments ago.
            failed_at = [stats.connection_failed_at(name) for name in names]
            if any(at is not None for at in failed_at):
                keep = [at is None for at in failed_at]
                if not any(keep):
                    # Every candidate failed moments ago: try the one that
                    # failed longest ago rather than fail without trying.
                    times = [at for at in failed_at if at is not None]  # all
                    keep[times.index(min(times))] = True
                error_cached = frozenset(
                    name for name, ok in zip(names, keep, strict=True) if not ok
                )
                survivors = [p for p, ok in zip(survivors, keep, strict=True) if ok]
                pendings = [n for n, ok in zip(pendings, keep, strict=True) if ok]
                names = [p.backend_name for p in survivors]
        unconfirmed: Sequence[PreparedTarget] = ()
        if need & ~routes.common_mask and len(survivors) > 1:
            # Unknown support does not exclude (the backend decides), but a
            # backend that confirms every needed capability goes first.
            confirmed = [not need & ~p.capability_mask for p in survivors]
            if any(confirmed) and not all(confirmed):
                unconfirmed = [
                    p for p, ok in zip(survivors, confirmed, strict=True) if not ok
                ]
                survivors = [
                    p for p, ok in zip(survivors, confirmed, strict=True) if ok
                ]
                pendings = [n for n, ok in zip(pendings, confirmed, strict=True) if ok]
                names = [p.backend_name for p in survivors]
        reported = stats.reported_loads
        if reported:
            # Backends that report their own load (relay workers, whose count
            # has every serving process's requests) score by the larger count.
            # Capacity above stays this process's count: the gateway-wide
            # limiter holds the slots, and a report is a heartbeat old.
            pendings = [
                pending
                if (other := reported.get(name)) is None or other < pending
                else other
                for pending, name in zip(pendings, names, strict=True)
            ]
        fresh_after = stats.clock() - stats.stale_after
        latencies = [
            seen[0] if seen is not None and seen[1] >= fresh_after else p.avg_latency_ms
            for p, seen in zip(survivors, map(latency_of, names), strict=True)
        ]
        totals: list[float] = []
        fleet_scores: Sequence[FleetScore] = ()
        no_memory: Sequence[tuple[PreparedTarget, FleetScore]] = ()
        if policy.strategy is Strategy.FLEET and survivors:
            now = stats.wall_clock()
            scored = [
                score_fleet(
                    p.target.backend, p.target.model, tokens, stats, policy.fleet, now
                )
                for p in survivors
            ]
            fits = [score.fits for score in scored]
            if not all(fits):
                no_memory = [
                    (p, score)
                    for p, score in zip(survivors, scored, strict=True)
                    if not score.fits
                ]
                survivors = [p for p, ok in zip(survivors, fits, strict=True) if ok]
                pendings = [n for n, ok in zip(pendings, fits, strict=True) if ok]
                latencies = [n for n, ok in zip(latencies, fits, strict=True) if ok]
                scored = [s for s in scored if s.fits]
            fleet_scores = scored
            totals = [score.total for score in scored]
        elif policy.strategy is Strategy.SMART:
            # score_backend() inlined (in-flight counts are never negative, nor
            # are latencies); test_strategies checks that the two agree.
            w_load = policy.weights.load
            w_latency = policy.weights.latency
            totals = [
                (
                    prepared.priority_points
                    + (100 - pending if pending < 100 else 0) * w_load
                    + (
                        100.0
                        if latency is None
                        else (100.0 - latency / 10.0 if latency < 1000.0 else 0.0)
                    )
                    * w_latency
                )
                / 100
                for prepared, pending, latency in zip(
                    survivors, pendings, latencies, strict=True
                )
            ]
        return Attempt(
            model=model,
            role=role,
            routes=routes,
            requirements=requirements,
            weights=policy.weights,
            survivors=survivors,
            in_flight=pendings,
            latencies=latencies,
            totals=totals,
            rejected=rejected,
            circuit_open=circuit_open,
            error_cached=error_cached,
            unconfirmed=unconfirmed,
            fleet_scores=fleet_scores,
            no_memory=no_memory,
        )

    def _choose(
        self,
        attempts: list[Attempt],
        via: Via,
        requirements: RequestRequirements,
        snapshot: RouterSnapshot,
        stats: LiveStats,
        onward_models: Sequence[str],
        take_turn: bool,
        prefix: PrefixRequest | None = None,
    ) -> Decision:
        served = attempts[-1]
        survivors = served.survivors
        strategy = snapshot.policy.strategy
        if len(survivors) == 1:
            index = 0
        elif strategy is Strategy.SMART or strategy is Strategy.FLEET:
            index = pick_smart(served.totals)
            tied = _tied_relay_workers(served, index)
            if len(tied) > 1:
                index = pick_rotating(index, tied, self._turn(served.model, take_turn))
        elif strategy is Strategy.ROUND_ROBIN:
            index = pick_round_robin(
                len(survivors), self._turn(served.model, take_turn)
            )
        elif strategy is Strategy.PRIORITY_ONLY:
            index = pick_priority_only(
                [prepared.priority for prepared in survivors],
                self._turn(served.model, take_turn),
            )
        else:
            index = pick_random(len(survivors), self._rng)
        choice: PrefixChoice | None = None
        if prefix is not None:
            index, choice = _choose_by_prefix(served, index, strategy, snapshot, prefix)
        return Decision(
            requirements=requirements,
            strategy=strategy,
            snapshot_version=snapshot.version,
            max_retries=snapshot.policy.max_retries,
            attempts=tuple(attempts),
            chosen_index=index,
            via=via,
            prefix=choice,
            # The rest of the chain, for when every backend of the served model
            # fails before answering (the proxy retries into it).
            onward=tuple(
                self._try_model(model, Role.FALLBACK, requirements, snapshot, stats)
                for model in onward_models
            ),
        )

    def _turn(self, model: str, take_turn: bool) -> int:
        if take_turn:
            return self._take_turn(model)
        # Explaining shows whose turn is next without taking it.
        return self._last_turn.get(model, -1) + 1

    def _take_turn(self, model: str) -> int:
        counter = self._turns.get(model)
        if counter is None:
            # setdefault is atomic, so racing first requests share one counter.
            counter = self._turns.setdefault(model, itertools.count())
        turn = next(counter)
        self._last_turn[model] = turn
        return turn


def _explain_failure(
    attempts: list[Attempt],
    alias_target: str | None,
    pattern: str | None,
    snapshot: RouterSnapshot,
) -> RoutingError:
    requested = attempts[0].model
    transient = [a for a in attempts if a.outcome is Outcome.NO_HEALTHY_BACKEND]
    mismatched = [a for a in attempts if a.outcome is Outcome.CAPABILITY_MISMATCH]
    chain_tried = any(a.role is Role.FALLBACK for a in attempts)

    if chain_tried and (transient or not mismatched):
        return FallbackChainExhausted(
            [a.model for a in attempts], [_OUTCOME_WORDS[a.outcome] for a in attempts]
        )
    if transient and not chain_tried:
        attempt = transient[0]
        return NoHealthyBackend(
            attempt.model, requested=requested, detail=attempt.summarize_exclusions()
        )
    if mismatched:
        missing: list[str] = []
        for attempt in mismatched:
            missing.extend(m for m in attempt.missing_capabilities if m not in missing)
        order = ("vision", "tools", "json_mode", "context_length")
        missing.sort(key=order.index)
        return CapabilityMismatch(
            requested,
            missing,
            detail=_context_detail(mismatched, missing),
            also_tried=[a.model for a in attempts[1:]],
        )
    if alias_target is not None:
        next_target = snapshot.aliases.get(alias_target)
        if next_target is not None:
            return CircularAlias(
                requested, alias_target=alias_target, next_target=next_target
            )
        return ModelNotFound(requested, alias_target=alias_target, pattern=pattern)
    return ModelNotFound(requested)


def _context_detail(mismatched: list[Attempt], missing: list[str]) -> str:
    if "context_length" not in missing:
        return ""
    tokens = mismatched[0].requirements.estimated_tokens
    contexts = [a.largest_context for a in mismatched]
    known = [c for c in contexts if c is not None]
    largest = f"; the longest context is {max(known)}" if known else ""
    return f"the request is about {tokens} tokens{largest}"


def _tied_relay_workers(attempt: Attempt, index: int) -> list[int]:
    """The relay workers scored as high as the chosen candidate, of its
    priority (which breaks ties first), when it is one of them."""
    survivors, totals = attempt.survivors, attempt.totals
    best = survivors[index]
    if best.target.backend.kind != RELAY_KIND:
        return []
    return [
        position
        for position, prepared in enumerate(survivors)
        if totals[position] == totals[index]
        and prepared.priority == best.priority
        and prepared.target.backend.kind == RELAY_KIND
    ]


def _choose_by_prefix(
    served: Attempt,
    index: int,
    strategy: Strategy,
    snapshot: RouterSnapshot,
    prefix: PrefixRequest,
) -> tuple[int, PrefixChoice]:
    """The strategy's choice `index`, or the backend the prompt's prefix or
    session points at (routing.core.prefix.choose_backend)."""
    survivors = served.survivors
    priorities = [prepared.priority for prepared in survivors]
    order = [index]
    if len(survivors) > 1:
        order += order_retries(
            strategy, index, totals=served.totals, priorities=priorities
        )
    # Under fleet, a backend's queue depth (in flight and waiting) is its load.
    loads = (
        [score.depth for score in served.fleet_scores]
        if served.fleet_scores
        else list(served.in_flight)
    )
    return choose_backend(
        order,
        [prepared.backend_name for prepared in survivors],
        loads,
        priorities,
        served.model,
        prefix,
        snapshot.policy.prefix,
        placing=strategy is Strategy.SMART or strategy is Strategy.FLEET,
    )
