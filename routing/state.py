"""What a serving process routes with: the gateway state, frozen.

``routing/snapshot.py`` builds it from the database (``build_state()``, off the
request path) and the gateway's snapshot holder swaps it in whole; the proxy
only ever reads a ``GatewayState``. Nothing here imports the ORM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from routing.admission import AdmissionSettings, Criticality
from routing.core import RouterSnapshot
from usage.limits.policy import KeyPolicy, Price


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
    # Key prefix -> its name (traces name the key, never its secret).
    key_names: Mapping[str, str] = field(default_factory=dict)
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
    # Add prompt-cache breakpoints to Anthropic backends' requests that have
    # none ([cache] anthropic_auto_breakpoints; gateway/protocols/prompt_cache).
    anthropic_auto_breakpoints: bool = False
    # Relay backend name -> the channel of the consumer holding its worker's
    # socket (connected workers only; gateway/relay/dispatch.py).
    relay_channels: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({})
    )

    @property
    def expires_at(self) -> float | None:
        """When a backend's health result goes stale (rebuild then); see routes."""
        return self.routes.expires_at
