"""What a serving process routes with: the gateway state, built from the database.

The gateway's snapshot holder calls ``build_state()`` off the request path and
swaps the result in whole; the proxy only ever reads a ``GatewayState``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from django.db import transaction

from backends.models import Worker
from routing.admission import AdmissionSettings, Criticality
from routing.core import RouterSnapshot
from routing.models import RoutingPolicy
from routing.snapshot import build_snapshot
from usage.limits.policy import KeyPolicy, Price, resolve_prices
from usage.limits.spend import read_budget_spend
from usage.models import ApiKey, ModelPrice

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KeyAdmission:
    """How a client key's requests take part in admission control."""

    weight: float = 1.0
    max_criticality: Criticality = Criticality.DEFAULT


@dataclass(frozen=True, slots=True)
class GatewayState:
    """Everything the proxy reads, frozen at one configuration version."""

    version: int
    routes: RouterSnapshot
    # SHA-256 hex of every active client key -> its visible prefix.
    keys: Mapping[str, str]
    # Key prefix -> its allow-list, expiry, limits and budgets (every active key).
    policies: Mapping[str, KeyPolicy] = field(default_factory=dict)
    # Served model name -> its price (models without a price are free).
    prices: Mapping[str, Price] = field(default_factory=dict)
    # (key prefix, budget period id) -> rolled-up (tokens, nano-USD), for keys
    # with a budget: where an in-process limiter's counters start.
    spend: Mapping[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    # Visible prefix -> the key's weight and highest criticality (only keys
    # that differ from the defaults).
    key_admission: Mapping[str, KeyAdmission] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # Relay backend name -> the channel of the consumer holding its worker's
    # socket (connected workers only; routing/relay/dispatch.py).
    relay_channels: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({})
    )

    @property
    def expires_at(self) -> float | None:
        """When a backend's health result goes stale (rebuild then); see routes."""
        return self.routes.expires_at


def build_state() -> GatewayState:
    """Read the routing tables and the active client keys (sync code only)."""
    with transaction.atomic():
        routes = build_snapshot()
        active = list(ApiKey.objects.active())
        stored_prices = {
            price.model: Price(price.input_nanos, price.output_nanos)
            for price in ModelPrice.objects.all()
        }
        spend = read_budget_spend()
        policy = RoutingPolicy.objects.filter(pk=RoutingPolicy.SINGLETON_PK).first()
        relay_channels = dict(
            Worker.objects.exclude(channel_name="")
            .filter(backend__isnull=False)
            .values_list("backend__name", "channel_name")
        )
    keys: dict[str, str] = {}
    key_admission: dict[str, KeyAdmission] = {}
    policies: dict[str, KeyPolicy] = {}
    for key in active:
        keys[key.hashed_key] = key.prefix
        limits = KeyAdmission(
            key.admission_weight, Criticality.parse(key.max_criticality)
        )
        if limits != KeyAdmission():
            key_admission[key.prefix] = limits
        policies[key.prefix] = key_policy(key)
    models = {
        model.name for backend in routes.backends for model in backend.models
    } | set(routes.routes)
    prices = resolve_prices(stored_prices, models)
    return GatewayState(
        version=routes.version,
        routes=routes,
        keys=MappingProxyType(keys),
        admission=_admission(policy),
        key_admission=MappingProxyType(key_admission),
        policies=MappingProxyType(policies),
        prices=MappingProxyType(prices),
        spend=MappingProxyType(spend),
        relay_channels=MappingProxyType(relay_channels),
    )


def key_policy(key: ApiKey) -> KeyPolicy:
    """The frozen policy the gateway enforces for one stored key."""
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
    )


def _admission(policy: RoutingPolicy | None) -> AdmissionSettings:
    if policy is None:
        return AdmissionSettings()
    try:
        return policy.admission_settings()
    except ValueError as error:
        # Only a row edited around the model's validation gets here.
        logger.error("Invalid admission settings, using the defaults: %s", error)
        return AdmissionSettings()
