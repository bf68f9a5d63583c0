"""The words every part of the router core shares: the bottom of the core.

Strategies, backend health, exclusion reasons and capability bits are named
here once, so that the core's other modules import downwards only (see the
import-linter contract "routing.core imports downwards"). This module imports
nothing from the rest of the core.
"""

from __future__ import annotations

import enum

from backends.vocabulary import HealthStatus

# The router reads health in the backends app's own words: one enum, which the
# core calls Health.
Health = HealthStatus

# Bits of a capability mask; a backend model offers a set, a request needs one.
VISION = 1
TOOLS = 2
JSON_MODE = 4


class Strategy(enum.StrEnum):
    """How to pick one backend among those that can serve a request."""

    SMART = "smart"
    ROUND_ROBIN = "round_robin"
    PRIORITY_ONLY = "priority_only"
    RANDOM = "random"
    # Loaded-model aware: the seven signals of routing/core/fleet.py.
    FLEET = "fleet"


class Reason(enum.StrEnum):
    """Why a backend was not a candidate for a request."""

    BACKEND_DISABLED = "backend_disabled"
    MODEL_DISABLED = "model_disabled"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    HEALTH_UNKNOWN = "health_unknown"
    # The last health result is too old to trust (health checks stopped).
    HEALTH_STALE = "health_stale"
    AT_CAPACITY = "at_capacity"
    # The proxy saw repeated failures: its circuit breaker opened this backend's
    # circuit for a cool-down (LiveStats.open_circuits), before any health probe.
    CIRCUIT_OPEN = "circuit_open"
    # A connection to it failed moments ago (refused, reset, no such host,
    # connect timeout): skipped for a few seconds (LiveStats.failed_connections,
    # the gateway's error cache) unless every candidate was.
    ERROR_CACHED = "error_cached"
    NO_VISION = "no_vision"
    NO_TOOLS = "no_tools"
    NO_JSON_MODE = "no_json_mode"
    CONTEXT_TOO_SHORT = "context_too_short"
    # Fleet strategy only: the model is not loaded here and does not fit in the
    # backend's free memory (memory ceiling minus the models loaded).
    NO_MEMORY = "no_memory"
    # Fleet strategy only: the model is not loaded here and the node takes no
    # new cold loads for now (memory pressure or repeated out-of-memory load
    # failures; routing/core/capacity.py).
    COLD_LOADS_PAUSED = "cold_loads_paused"
    # Not excluded but deferred: the model's support for a capability the
    # request needs is unknown while another backend confirms it; tried after
    # the confirmed ones.
    CAPABILITY_UNCONFIRMED = "capability_unconfirmed"


class Trend(enum.StrEnum):
    """Whether a backend is freeing up or getting busier (fleet signal 6)."""

    RISING = "rising"
    STABLE = "stable"
    FALLING = "falling"


class Thermal(enum.StrEnum):
    """How ready a backend is to run a model now (fleet signal 1)."""

    HOT = "hot"  # loaded in memory
    WARM = "warm"  # unloaded recently (likely still in the OS page cache)
    ON_DISK = "on_disk"  # listed by the backend, not loaded recently
    ABSENT = "absent"  # not listed: it would have to be pulled first
