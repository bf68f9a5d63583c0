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

from routing.admission import AdmissionSettings, Criticality
from routing.core import RouterSnapshot
from routing.models import RoutingPolicy
from routing.snapshot import build_snapshot
from usage.models import ApiKey

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
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    # Visible prefix -> the key's weight and highest criticality (only keys
    # that differ from the defaults).
    key_admission: Mapping[str, KeyAdmission] = field(
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
        rows = ApiKey.objects.active().values_list(
            "hashed_key", "prefix", "admission_weight", "max_criticality"
        )
        keys: dict[str, str] = {}
        key_admission: dict[str, KeyAdmission] = {}
        for hashed, prefix, weight, max_criticality in rows:
            keys[hashed] = prefix
            limits = KeyAdmission(weight, Criticality.parse(max_criticality))
            if limits != KeyAdmission():
                key_admission[prefix] = limits
        policy = RoutingPolicy.objects.filter(pk=RoutingPolicy.SINGLETON_PK).first()
    return GatewayState(
        version=routes.version,
        routes=routes,
        keys=MappingProxyType(keys),
        admission=_admission(policy),
        key_admission=MappingProxyType(key_admission),
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
