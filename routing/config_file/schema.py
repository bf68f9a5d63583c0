"""The configuration file format: its keys, the fields they set, and its entries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import models

from routing.core import FLEET_SETTINGS


@dataclass(frozen=True)
class Setting:
    """A scalar key of a table and the model field it sets."""

    key: str
    field: str
    value_type: type[str | bool | int | float]
    expected: str
    required: bool = False
    # Also accepts the string "auto", meaning None (a capability left unknown).
    allows_auto: bool = False


AUTO = "auto"
AUTO_EXPECTED = 'true, false or "auto" (unknown: the backend decides)'
POLICY_SETTINGS = (
    Setting("strategy", "strategy", str, 'a strategy name such as "smart"'),
    Setting("max_retries", "max_retries", int, "a non-negative integer"),
)
WEIGHT_SETTINGS = (
    Setting("priority", "weight_priority", int, "an integer from 0 to 100"),
    Setting("load", "weight_load", int, "an integer from 0 to 100"),
    Setting("latency", "weight_latency", int, "an integer from 0 to 100"),
)
ADMISSION_SETTINGS = (
    Setting("enabled", "admission_enabled", bool, "true or false"),
    Setting("flow_key", "admission_flow_key", str, '"key", "model" or "key+model"'),
    Setting("sizing", "admission_sizing", str, '"tokens" or "fixed"'),
    Setting(
        "default_output_tokens",
        "admission_default_output_tokens",
        int,
        "a non-negative integer",
    ),
    Setting("total_capacity", "admission_total_capacity", int, "a positive integer"),
    Setting("flow_capacity", "admission_flow_capacity", int, "a positive integer"),
    Setting(
        "critical_reserved",
        "admission_critical_reserved",
        int,
        "a non-negative integer",
    ),
    Setting("queue_ttl", "admission_queue_ttl", float, "a number of seconds"),
    Setting("critical_share", "admission_critical_share", int, "a whole number 0-100"),
    Setting("default_share", "admission_default_share", int, "a whole number 0-100"),
    Setting(
        "sheddable_share", "admission_sheddable_share", int, "a whole number 0-100"
    ),
    Setting("stock_unit", "admission_stock_unit", str, '"requests" or "tokens"'),
    Setting(
        "watermark_tokens_per_backend",
        "admission_watermark_tokens_per_backend",
        float,
        "a positive number",
    ),
    Setting(
        "watermark_per_backend",
        "admission_watermark_per_backend",
        float,
        "a positive number",
    ),
    Setting(
        "percentage_deviation_for_bounds",
        "admission_percentage_deviation_for_bounds",
        float,
        "a number between 0 and 1",
    ),
    Setting(
        "lower_bound_per_backend",
        "admission_lower_bound_per_backend",
        float,
        "a non-negative number",
    ),
    Setting(
        "upper_bound_per_backend",
        "admission_upper_bound_per_backend",
        float,
        "a positive number",
    ),
)
# [routing.fleet]: keys named as the policy fields (routing.core FLEET_SETTINGS).
FLEET_TOML_SETTINGS = tuple(
    Setting(
        setting.name,
        setting.name,
        setting.kind,
        f"{'a whole number' if setting.kind is int else 'a number'} from "
        f"{setting.low:g} to {setting.high:g}",
    )
    for setting in FLEET_SETTINGS
)
# [routing.context_shift]: trimming chats that overflow a model's context.
CONTEXT_SHIFT_SETTINGS = (
    Setting("enabled", "context_shift_enabled", bool, "true or false"),
    Setting(
        "keep_last_messages",
        "context_shift_keep_last_messages",
        int,
        "a whole number from 1 to 1000",
    ),
    Setting(
        "max_retries", "context_shift_max_retries", int, "a whole number from 0 to 5"
    ),
)
# [routing.ensemble]: multiple opinions (moe-<model>).
ENSEMBLE_SETTINGS = (
    Setting("opinions", "ensemble_opinions", int, "a whole number from 1 to 8"),
    Setting("critique_prompt", "ensemble_critique_prompt", str, "a string"),
    Setting("refine_prompt", "ensemble_refine_prompt", str, "a string"),
    Setting(
        "step_timeout_seconds",
        "ensemble_step_timeout_seconds",
        float,
        "a number of seconds from 1 to 3600",
    ),
)
# [cache]: the exact response cache and prompt caching (docs/caching.md);
# stored on the routing policy.
CACHE_SETTINGS = (
    Setting("enabled", "cache_enabled", bool, "true or false"),
    Setting("ttl_seconds", "cache_ttl_seconds", int, "a whole number of seconds"),
    Setting("scope", "cache_scope", str, '"key" or "shared"'),
    Setting("max_entry_bytes", "cache_max_entry_bytes", int, "a positive integer"),
    Setting("only_deterministic", "cache_only_deterministic", bool, "true or false"),
    Setting(
        "anthropic_auto_breakpoints",
        "cache_anthropic_auto_breakpoints",
        bool,
        "true or false",
    ),
)
# [routing.prefix]: prefix-aware routing and session affinity.
PREFIX_SETTINGS = (
    Setting("enabled", "prefix_enabled", bool, "true or false"),
    Setting(
        "block_chars", "prefix_block_chars", int, "a whole number from 16 to 65536"
    ),
    Setting(
        "max_imbalance",
        "prefix_max_imbalance",
        int,
        "a whole number of requests from 0 to 10000",
    ),
    Setting(
        "max_imbalance_ratio",
        "prefix_max_imbalance_ratio",
        float,
        "a number from 0 to 100",
    ),
    Setting(
        "cache_blocks",
        "prefix_cache_blocks",
        int,
        "a whole number from 1 to 1000000",
    ),
    Setting(
        "session_keys",
        "prefix_session_keys",
        str,
        'a string of comma-separated keys, e.g. "x-session-id,user"',
    ),
    Setting(
        "session_ttl_seconds",
        "prefix_session_ttl_seconds",
        float,
        "a number of seconds above 0, at most 604800",
    ),
)
# [routing.shadows."<model>"] and [routing.hedging."<model>"] (docs/splits.md).
SHADOW_SETTINGS = (
    Setting("model", "shadow_model", str, "a model name", required=True),
    Setting("percent", "percent", float, "a number from 0 to 100"),
    Setting("timeout_seconds", "timeout_seconds", float, "a number of seconds"),
    Setting("keep", "keep", int, "a whole number from 1 to 1000"),
    Setting("max_answer_chars", "max_answer_chars", int, "a whole number"),
)
HEDGE_SETTINGS = (
    Setting("after", "after", str, '"fixed" or "p95"'),
    Setting("after_ms", "after_ms", int, "a whole number of milliseconds"),
    Setting("max_extra", "max_extra", int, "a whole number from 1 to 3"),
    Setting("max_body_bytes", "max_body_bytes", int, "a whole number of bytes"),
)
SPLIT_KEYS = ("targets", "sticky")
MODEL_WEIGHTS_KEY = "model_weights"
MODEL_WEIGHTS_FIELD = "admission_model_weights"
MODEL_OUTPUT_TOKENS_KEY = "model_output_tokens"
MODEL_OUTPUT_TOKENS_FIELD = "admission_model_output_tokens"
# [routing.admission.<key>] tables of model name = number: (key, field, type,
# what a value must be).
ADMISSION_MODEL_TABLES = (
    (MODEL_WEIGHTS_KEY, MODEL_WEIGHTS_FIELD, float, "a positive number"),
    (MODEL_OUTPUT_TOKENS_KEY, MODEL_OUTPUT_TOKENS_FIELD, int, "a non-negative integer"),
)
BACKEND_SETTINGS = (
    Setting("name", "name", str, "a string", required=True),
    Setting("url", "base_url", str, "a URL string", required=True),
    Setting("kind", "kind", str, 'a backend kind such as "openai" or "ollama"'),
    Setting("priority", "priority", int, "a non-negative integer"),
    Setting("enabled", "enabled", bool, "true or false"),
    Setting("max_concurrency", "max_concurrency", int, "a positive integer"),
    Setting("timeout", "request_timeout", float, "a positive number of seconds"),
    Setting("memory_ceiling_gb", "memory_ceiling_gb", float, "a positive number"),
    Setting("tier", "tier", str, '"large", "medium" or "small"'),
    Setting(
        "prefix_cache_tokens",
        "prefix_cache_tokens",
        int,
        "a positive whole number of tokens",
    ),
)
MODEL_SETTINGS = (
    Setting("name", "name", str, "a string", required=True),
    Setting("context_length", "context_length", int, "a positive integer"),
    Setting("vision", "supports_vision", bool, AUTO_EXPECTED, allows_auto=True),
    Setting("tools", "supports_tools", bool, AUTO_EXPECTED, allows_auto=True),
    Setting("json_mode", "supports_json_mode", bool, AUTO_EXPECTED, allows_auto=True),
    Setting("enabled", "enabled", bool, "true or false"),
    Setting("parameters_b", "parameters_b", float, "a number of billions"),
    Setting("max_concurrency", "max_concurrency", int, "a positive integer"),
)

# [[keys]]: settings of client keys that exist (a file never holds secrets).
KEY_SETTINGS = (
    Setting("name", "name", str, "a string", required=True),
    Setting("rpm", "rpm_limit", int, "a positive integer"),
    Setting("tpm", "tpm_limit", int, "a positive integer"),
    Setting("max_concurrency", "max_concurrency", int, "a positive integer"),
    Setting("budget_period", "budget_period", str, '"day", "month" or "total"'),
    Setting("budget_tokens", "budget_tokens", int, "a positive integer"),
    Setting("weight", "admission_weight", float, "a positive number"),
    Setting(
        "max_criticality",
        "max_criticality",
        str,
        '"critical", "default" or "sheddable"',
    ),
    Setting("manage_models", "can_manage_models", bool, "true or false"),
)
KEY_MODELS = "models"
KEY_EXPIRES = "expires"
KEY_BUDGET_USD = "budget_usd"
KEY_TEAM = "team"
KEY_KEYS = (
    *(s.key for s in KEY_SETTINGS),
    KEY_MODELS,
    KEY_EXPIRES,
    KEY_BUDGET_USD,
    KEY_TEAM,
)
# [[teams]]: teams of client keys and the limits they share (created by name).
TEAM_SETTINGS = (
    Setting("name", "name", str, "a string", required=True),
    Setting("rpm", "rpm_limit", int, "a positive integer"),
    Setting("tpm", "tpm_limit", int, "a positive integer"),
    Setting("max_concurrency", "max_concurrency", int, "a positive integer"),
    Setting("budget_period", "budget_period", str, '"day", "month" or "total"'),
    Setting("budget_tokens", "budget_tokens", int, "a positive integer"),
)
TEAM_KEYS = (*(s.key for s in TEAM_SETTINGS), KEY_BUDGET_USD)
# USD per million tokens: input, output, cached input read, cache writes, and
# an answer from the response cache.
PRICE_KEYS = (
    "input",
    "output",
    "cached_input",
    "cache_write",
    "cache_hit",
    "batch_factor",
)

ROUTING_KEYS = (
    "strategy",
    "max_retries",
    "weights",
    "admission",
    "fleet",
    "context_shift",
    "ensemble",
    "prefix",
    "aliases",
    "fallbacks",
    "splits",
    "shadows",
    "hedging",
)
ADMISSION_KEYS = (
    *(s.key for s in ADMISSION_SETTINGS),
    *(key for key, _, _, _ in ADMISSION_MODEL_TABLES),
)
BACKEND_KEYS = (*(s.key for s in BACKEND_SETTINGS), "api_key", "api_key_env", "models")
MODEL_KEYS = tuple(s.key for s in MODEL_SETTINGS)

# Model field -> the key that sets it, for naming full_clean() errors.
POLICY_KEY_FOR_FIELD = (
    {s.field: s.key for s in POLICY_SETTINGS}
    | {s.field: f"weights.{s.key}" for s in WEIGHT_SETTINGS}
    | {s.field: f"admission.{s.key}" for s in ADMISSION_SETTINGS}
    | {field: f"admission.{key}" for key, field, _, _ in ADMISSION_MODEL_TABLES}
    | {s.field: f"fleet.{s.key}" for s in FLEET_TOML_SETTINGS}
    | {s.field: f"context_shift.{s.key}" for s in CONTEXT_SHIFT_SETTINGS}
    | {s.field: f"ensemble.{s.key}" for s in ENSEMBLE_SETTINGS}
    | {s.field: f"cache.{s.key}" for s in CACHE_SETTINGS}
    | {s.field: f"prefix.{s.key}" for s in PREFIX_SETTINGS}
)
BACKEND_KEY_FOR_FIELD = {s.field: s.key for s in BACKEND_SETTINGS} | {
    "api_key": "api_key"
}
MODEL_KEY_FOR_FIELD = {s.field: s.key for s in MODEL_SETTINGS}
KEY_KEY_FOR_FIELD = {s.field: s.key for s in KEY_SETTINGS} | {
    "allowed_models": KEY_MODELS,
    "expires_at": KEY_EXPIRES,
    "budget_usd": KEY_BUDGET_USD,
    "team": KEY_TEAM,
}
TEAM_KEY_FOR_FIELD = {s.field: s.key for s in TEAM_SETTINGS} | {
    "budget_usd": KEY_BUDGET_USD,
}
PRICE_KEY_FOR_FIELD = {
    "input_per_million": "input",
    "output_per_million": "output",
    "cached_input_per_million": "cached_input",
    "cache_write_per_million": "cache_write",
    "cache_hit_per_million": "cache_hit",
    "batch_price_factor": "batch_factor",
}


@dataclass(frozen=True)
class ModelEntry:
    """One ``[[backends.models]]`` table."""

    path: str
    name: str
    # Every configurable field; keys the file leaves out hold the field default.
    values: Mapping[str, Any]
    # Fields whose key had a problem already reported (wrong type, missing).
    invalid: frozenset[str] = frozenset()


@dataclass(frozen=True)
class BackendEntry:
    """One ``[[backends]]`` table with its models."""

    path: str
    name: str
    values: Mapping[str, Any]
    models: tuple[ModelEntry, ...]
    invalid: frozenset[str] = frozenset()
    # None keeps the key already stored. Hidden from repr() so that no
    # traceback or log line can show it.
    api_key: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class AliasEntry:
    """One ``name = "target"`` line of ``[routing.aliases]``."""

    path: str
    name: str
    target: str


@dataclass(frozen=True)
class ChainEntry:
    """One ``model = [fallbacks...]`` line of ``[routing.fallbacks]``."""

    path: str
    model: str
    fallbacks: tuple[str, ...]


@dataclass(frozen=True)
class SplitEntry:
    """One ``[routing.splits."<name>"]`` table: targets by weight, stickiness."""

    path: str
    name: str
    sticky: str
    targets: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class ModelTableEntry:
    """One ``[routing.shadows."<model>"]`` or ``[routing.hedging."<model>"]``."""

    path: str
    model: str
    values: Mapping[str, Any]
    invalid: frozenset[str] = frozenset()


@dataclass(frozen=True)
class KeyEntry:
    """One ``[[keys]]`` table: the limits of the stored client key it names."""

    path: str
    name: str
    # Every setting; keys the file leaves out hold the default (no limit).
    values: Mapping[str, Any]
    invalid: frozenset[str] = frozenset()


@dataclass(frozen=True)
class TeamEntry:
    """One ``[[teams]]`` table: a team of client keys and its shared limits."""

    path: str
    name: str
    # Every setting; keys the file leaves out hold the default (no limit).
    values: Mapping[str, Any]
    invalid: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PriceEntry:
    """One ``model = { input = ..., output = ... }`` line of ``[prices]``."""

    path: str
    model: str
    values: Mapping[str, Any]
    invalid: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ConfigFile:
    """A parsed configuration file and the problems found in its shape.

    Entries keep what could be read, so that the models' validation can still
    report on the rest; a file with any problem is never applied.
    """

    # Only the routing policy keys the file gives (model field -> value).
    policy: Mapping[str, Any]
    aliases: tuple[AliasEntry, ...]
    fallbacks: tuple[ChainEntry, ...]
    backends: tuple[BackendEntry, ...]
    keys: tuple[KeyEntry, ...] = ()
    prices: tuple[PriceEntry, ...] = ()
    teams: tuple[TeamEntry, ...] = ()
    splits: tuple[SplitEntry, ...] = ()
    shadows: tuple[ModelTableEntry, ...] = ()
    hedging: tuple[ModelTableEntry, ...] = ()
    policy_invalid: frozenset[str] = frozenset()
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def get_field_default(model: type[models.Model], name: str) -> Any:
    """Return the value a new row of ``model`` gets for field ``name``."""
    model_field = model._meta.get_field(name)
    assert isinstance(model_field, models.Field), name
    return model_field.get_default()
