"""The only bridge from the database to what a serving process routes with.

``build_snapshot()`` reads the routing tables into the router core's
``RouterSnapshot``; ``build_state()`` adds the client keys, prices, spend and
relay channels into the frozen ``GatewayState`` (routing/state.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime
from types import MappingProxyType

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from backends.models import Backend, BackendKind, BackendModel, HealthStatus, Worker
from backends.worker_models import ModelRules
from routing.admission import AdmissionSettings, Criticality
from routing.core import (
    FLEET_SETTINGS,
    MAX_RETRIES_ENV,
    STRATEGY_ENV,
    BackendSpec,
    ModelSpec,
    Policy,
    RouterSnapshot,
    apply_overrides,
    make_policy,
)
from routing.core.traffic import HedgePolicy, Split
from routing.models import (
    Alias,
    FallbackChain,
    Hedging,
    RoutingPolicy,
    Shadow,
    TrafficSplit,
)
from routing.state import GatewayState, KeyAdmission
from routing.versioning import read_config_version
from usage.limits.policy import (
    KeyPolicy,
    Price,
    TeamPolicy,
    resolve_prices,
    team_prefix,
)
from usage.limits.spend import read_budget_spend
from usage.models import ApiKey, ModelPrice, Team

logger = logging.getLogger(__name__)


def build_snapshot() -> RouterSnapshot:
    """Read every routing table into an immutable RouterSnapshot (sync code only).

    The version is read before the data, so a snapshot is never older than the
    version it claims: a change committed in between makes the data newer, and
    the announced version triggers one more (harmless) rebuild.
    """
    now = timezone.now()
    with transaction.atomic():
        version = read_config_version()
        rows = list(Backend.objects.select_related("worker").prefetch_related("models"))
        direct = _direct_model_names(rows)
        backends = [_backend_spec(backend, now, direct) for backend in rows]
        aliases = dict(Alias.objects.values_list("name", "target"))
        fallbacks = {
            chain.model: [step.model for step in chain.steps.all()]
            for chain in FallbackChain.objects.prefetch_related("steps")
        }
        stored = RoutingPolicy.objects.filter(pk=RoutingPolicy.SINGLETON_PK).first()
        splits = _splits()
    policy = _policy(stored) if stored is not None else Policy()
    return RouterSnapshot.build(
        version=version,
        backends=backends,
        aliases=aliases,
        fallbacks=fallbacks,
        policy=apply_overrides(policy, read_policy_overrides()),
        expires_at=_first_expiry(rows, now),
        splits=splits,
    )


def _splits() -> list[Split]:
    splits = []
    for row in TrafficSplit.objects.prefetch_related("targets"):
        try:
            splits.append(row.as_split())
        except ValueError as error:
            # Only rows edited around the models' validation get here.
            logger.error("Split %r is ignored: %s", row.name, error)
    return splits


def _first_expiry(backends: list[Backend], now: datetime) -> float | None:
    """When the first routable backend's health result goes stale, or the first
    loaded model's keep_alive ends (a refreshed one is stored unannounced:
    BackendModel.objects.set_loaded), whichever comes first."""
    expiries = [
        expires.timestamp()
        for backend in backends
        if backend.enabled
        and backend.status == HealthStatus.HEALTHY
        and (expires := backend.health_expires_at()) is not None
        and expires > now
    ]
    expiries += [
        model.expires_at.timestamp()
        for backend in backends
        if backend.enabled
        for model in backend.models.all()
        if model.loaded and model.expires_at is not None and model.expires_at > now
    ]
    return min(expiries, default=None)


def read_policy_overrides() -> dict[str, str]:
    """Return the routing policy overrides set in settings, by variable name.

    Only the variables that are set (NEXUS_ROUTING_STRATEGY,
    NEXUS_ROUTING_MAX_RETRIES, NEXUS_ROUTING_FLEET_*), in the form
    apply_overrides() reads.
    """
    overrides = {}
    if settings.NEXUS_ROUTING_STRATEGY:
        overrides[STRATEGY_ENV] = settings.NEXUS_ROUTING_STRATEGY
    if settings.NEXUS_ROUTING_MAX_RETRIES is not None:
        overrides[MAX_RETRIES_ENV] = str(settings.NEXUS_ROUTING_MAX_RETRIES)
    fleet = settings.NEXUS_ROUTING_FLEET
    for setting in FLEET_SETTINGS:
        if setting.name in fleet:
            overrides[setting.env_name] = str(fleet[setting.name])
    return overrides


def _direct_model_names(backends: list[Backend]) -> frozenset[str]:
    """What direct backends list (demo ones aside): backends.workers's rule."""
    return frozenset(
        model.name
        for backend in backends
        if backend.kind != BackendKind.RELAY and not backend.is_demo
        for model in backend.models.all()
    )


def _served_models(backend: Backend, direct: frozenset[str]) -> list[BackendModel]:
    """The backend's models the router may send it: for a relay worker, those
    its credential allows and no direct backend lists (unless it may shadow
    them), whatever it announced when it registered (backends/worker_models.py)."""
    models = list(backend.models.all())
    if backend.kind != BackendKind.RELAY:
        return models
    worker = getattr(backend, "worker", None)
    rules = worker.model_rules if worker is not None else ModelRules()
    return [model for model in models if not rules.refusal(model.name, direct)]


def _backend_spec(
    backend: Backend, now: datetime, direct: frozenset[str]
) -> BackendSpec:
    return BackendSpec(
        id=backend.pk,
        name=backend.name,
        base_url=backend.base_url,
        kind=backend.kind,
        api_key=backend.api_key,
        enabled=backend.enabled,
        priority=backend.priority,
        max_concurrency=backend.max_concurrency,
        request_timeout=backend.request_timeout,
        status=backend.status,
        avg_latency_ms=backend.avg_latency_ms,
        health_stale=backend.is_health_stale(now),
        memory_ceiling_gb=backend.memory_ceiling_gb,
        tier=backend.tier,
        # The operator's size, else what the server reports.
        prefix_cache_tokens=backend.prefix_cache_tokens
        or backend.prefix_cache_reported_tokens,
        memory_total_gb=_gigabytes(backend.memory_total_bytes),
        memory_reported_used_gb=_gigabytes(backend.memory_used_bytes),
        memory_pressure=backend.memory_pressure,
        slots=backend.slots,
        memory_reported_at=_epoch(backend.memory_reported_at),
        models=tuple(
            _model_spec(backend, model) for model in _served_models(backend, direct)
        ),
    )


# Kinds that run exactly what they list: every model they serve is in memory.
_ALWAYS_LOADED = frozenset({BackendKind.VLLM, BackendKind.LLAMACPP})
_GB = 1e9


def _model_spec(backend: Backend, model: BackendModel) -> ModelSpec:
    return ModelSpec(
        name=model.name,
        context_length=model.context_length,
        supports_vision=model.supports_vision,
        supports_tools=model.supports_tools,
        supports_json_mode=model.supports_json_mode,
        loaded=model.loaded or backend.kind in _ALWAYS_LOADED,
        enabled=model.enabled,
        size_gb=_gigabytes(model.size_bytes),
        vram_gb=_gigabytes(model.vram_bytes),
        loaded_context=model.loaded_context_length,
        expires_at=_epoch(model.expires_at),
        last_loaded_at=_epoch(model.last_loaded_at),
        parameters_b=model.parameters_b,
        # An Ollama model only an operator listed may not be on the backend's
        # disk; other kinds list what they serve, or cannot list at all.
        listed=model.discovered or backend.kind != BackendKind.OLLAMA,
        max_concurrency=model.max_concurrency,
        kv_bytes_per_token=model.kv_bytes_per_token,
    )


def _gigabytes(size: int | None) -> float | None:
    return None if size is None else size / _GB


def _epoch(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


def _policy(stored: RoutingPolicy) -> Policy:
    try:
        fleet = stored.fleet_policy()
    except ValueError as error:
        # Only a row edited around the model's validation gets here.
        logger.error("Invalid fleet settings, using the defaults: %s", error)
        fleet = None
    policy = make_policy(
        strategy=stored.strategy,
        weight_priority=stored.weight_priority,
        weight_load=stored.weight_load,
        weight_latency=stored.weight_latency,
        max_retries=stored.max_retries,
        fleet=fleet,
    )
    try:
        policy = replace(policy, context_shift=stored.context_shift_policy())
    except ValueError as error:
        logger.error("Invalid context shift settings, using the defaults: %s", error)
    try:
        policy = replace(policy, ensemble=stored.ensemble_policy())
    except ValueError as error:
        logger.error("Invalid ensemble settings, using the defaults: %s", error)
    try:
        policy = replace(policy, prefix=stored.prefix_policy())
    except ValueError as error:
        logger.error("Invalid prefix settings, using the defaults: %s", error)
    try:
        return replace(policy, cache=stored.cache_policy())
    except ValueError as error:
        logger.error("Invalid cache settings, using the defaults: %s", error)
        return policy


def build_state() -> GatewayState:
    """Read the routing tables and the active client keys (sync code only)."""
    with transaction.atomic():
        routes = build_snapshot()
        active = list(ApiKey.objects.active().select_related("team"))
        stored_prices = {
            price.model: Price(
                price.input_nanos,
                price.output_nanos,
                price.cached_input_nanos,
                price.cache_write_nanos,
                cache_hit_nanos=price.cache_hit_nanos,
                batch_factor=float(price.batch_price_factor),
            )
            for price in ModelPrice.objects.all()
        }
        spend = read_budget_spend()
        policy = RoutingPolicy.objects.filter(pk=RoutingPolicy.SINGLETON_PK).first()
        shadows = {row.model: row.as_policy() for row in Shadow.objects.all()}
        hedging = {row.model: _hedge(row) for row in Hedging.objects.all()}
        relay_channels = dict(
            Worker.objects.exclude(channel_name="")
            .filter(backend__isnull=False)
            .values_list("backend__name", "channel_name")
        )
    keys: dict[str, str] = {}
    key_names: dict[str, str] = {}
    key_admission: dict[str, KeyAdmission] = {}
    policies: dict[str, KeyPolicy] = {}
    teams: dict[int, TeamPolicy | None] = {}
    for key in active:
        keys[key.hashed_key] = key.prefix
        key_names[key.prefix] = key.name
        limits = KeyAdmission(
            key.admission_weight, Criticality.parse(key.max_criticality)
        )
        if limits != KeyAdmission():
            key_admission[key.prefix] = limits
        team = None
        if key.team is not None:
            if key.team.pk not in teams:
                teams[key.team.pk] = team_policy(key.team)
            team = teams[key.team.pk]
        policies[key.prefix] = key_policy(key, team)
    models = {
        model.name for backend in routes.backends for model in backend.models
    } | set(routes.routes)
    prices = resolve_prices(stored_prices, models)
    return GatewayState(
        version=routes.version,
        routes=routes,
        keys=MappingProxyType(keys),
        key_names=MappingProxyType(key_names),
        admission=_admission(policy),
        key_admission=MappingProxyType(key_admission),
        policies=MappingProxyType(policies),
        prices=MappingProxyType(prices),
        anthropic_auto_breakpoints=bool(
            policy is not None and policy.cache_anthropic_auto_breakpoints
        ),
        spend=MappingProxyType(spend),
        relay_channels=MappingProxyType(relay_channels),
        shadows=MappingProxyType(shadows),
        hedging=MappingProxyType(
            {model: hedge for model, hedge in hedging.items() if hedge is not None}
        ),
    )


def _hedge(row: Hedging) -> HedgePolicy | None:
    try:
        return row.as_policy()
    except ValueError as error:
        logger.error("Hedging of %r is ignored: %s", row.model, error)
        return None


def team_policy(team: Team) -> TeamPolicy | None:
    """The frozen limits of a team (None when it limits nothing)."""
    policy = TeamPolicy(
        prefix=team_prefix(team.pk),
        name=team.name,
        max_concurrency=team.max_concurrency,
        rpm=team.rpm_limit,
        tpm=team.tpm_limit,
        budget_period=team.budget_period,
        budget_tokens=team.budget_tokens,
        budget_nanos=team.budget_nanos,
    )
    return policy if policy.is_limited else None


def key_policy(key: ApiKey, team: TeamPolicy | None = None) -> KeyPolicy:
    """The frozen policy the gateway enforces for one stored key (and `team`,
    its team's limits, which it also draws on)."""
    return KeyPolicy(
        prefix=key.prefix,
        allowed_models=key.model_patterns,
        expires_at=key.expires_at.timestamp() if key.expires_at else None,
        max_concurrency=key.max_concurrency,
        rpm=key.rpm_limit,
        tpm=key.tpm_limit,
        budget_period=key.budget_period,
        budget_tokens=key.budget_tokens,
        budget_nanos=key.budget_nanos,
        can_manage_models=key.can_manage_models,
        team=team,
    )


def _admission(policy: RoutingPolicy | None) -> AdmissionSettings:
    headroom = settings.NEXUS_BATCH_HEADROOM
    if policy is None:
        return AdmissionSettings(batch_headroom=headroom)
    try:
        return replace(policy.admission_settings(), batch_headroom=headroom)
    except ValueError as error:
        # Only a row edited around the model's validation gets here.
        logger.error("Invalid admission settings, using the defaults: %s", error)
        return AdmissionSettings(batch_headroom=headroom)
