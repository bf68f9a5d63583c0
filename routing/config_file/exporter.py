"""Write the routing configuration in the format the importer reads."""

from __future__ import annotations

from datetime import UTC

from backends.models import Backend, BackendKind
from routing.config_file.literals import format_key, format_scalar, format_string
from routing.config_file.schema import (
    ADMISSION_MODEL_TABLES,
    ADMISSION_SETTINGS,
    AUTO,
    BACKEND_SETTINGS,
    CACHE_SETTINGS,
    CONTEXT_SHIFT_SETTINGS,
    ENSEMBLE_SETTINGS,
    FLEET_TOML_SETTINGS,
    KEY_SETTINGS,
    MODEL_SETTINGS,
    POLICY_SETTINGS,
    PREFIX_SETTINGS,
    TEAM_SETTINGS,
    WEIGHT_SETTINGS,
    Setting,
    get_field_default,
)
from routing.config_file.traffic_tables import export_traffic
from routing.models import Alias, FallbackChain, RoutingPolicy, Strategy
from usage.models import ApiKey, ModelPrice, Team

HEADER = """\
# Nexus routing configuration, written by `manage.py nexus_export_config`.
# Load it with `manage.py nexus_import_config FILE`; add --replace to also delete
# what this file does not mention. API keys are never exported. Demo backends
# are left out: nexus_run manages them.
"""
KEYS_NOTE = """\
# Limits of client keys (docs/tenancy.md), matched by name.
# The keys themselves are created with nexus_create_key, the admin or the API;
# their secrets are never in a file. Keys without any limit are left out.
"""
TEAMS_NOTE = """\
# Teams of client keys: limits and budgets their keys share, on top of each
# key's own (docs/tenancy.md). A key joins one with team = "NAME" below.
"""
API_KEY_NOTE = """\
# This backend has an API key, which is never exported. Re-importing this file
# into the same Nexus keeps it; anywhere else, provide it with
# api_key_env = "NAME_OF_A_VARIABLE" (or api_key = "...").
"""


def export_config() -> str:
    """Return the configuration as TOML, in a stable order, without API keys."""
    policy = RoutingPolicy.objects.filter(pk=RoutingPolicy.SINGLETON_PK).first()
    policy = policy or RoutingPolicy()
    strategies = " | ".join(Strategy)
    lines = [HEADER, "[routing]"]
    lines += _settings(policy, POLICY_SETTINGS)
    lines[-len(POLICY_SETTINGS)] += f"  # {strategies}"
    lines += [
        "",
        "[routing.weights]",
        "# Scoring weights of the smart strategy; they sum to 100.",
    ]
    lines += _settings(policy, WEIGHT_SETTINGS)
    lines += [
        "",
        "[routing.admission]",
        "# Fair queuing in Nexus when backends are busy (docs/admission.md).",
    ]
    lines += _settings(policy, ADMISSION_SETTINGS)
    for table, field, _, _ in ADMISSION_MODEL_TABLES:
        lines += ["", f"[routing.admission.{table}]"]
        numbers = getattr(policy, field) or {}
        for model in sorted(numbers):
            lines.append(f"{format_string(model)} = {format_scalar(numbers[model])}")

    lines += [
        "",
        "[routing.fleet]",
        "# The fleet strategy's points and queues (docs/fleet.md);",
        "# without hold_seconds: 30 under the fleet strategy, 0 otherwise.",
    ]
    lines += _settings(policy, FLEET_TOML_SETTINGS)

    lines += [
        "",
        "[routing.context_shift]",
        "# Trim a chat that overflows a model's context and resend it.",
    ]
    lines += _settings(policy, CONTEXT_SHIFT_SETTINGS)

    lines += [
        "",
        "[routing.ensemble]",
        "# Multiple opinions for moe-<model>; an empty prompt is the default.",
    ]
    lines += _settings(policy, ENSEMBLE_SETTINGS)

    lines += [
        "",
        "[routing.prefix]",
        "# Prefix-aware routing and session affinity (docs/prefix.md).",
    ]
    lines += _settings(policy, PREFIX_SETTINGS)

    lines += [
        "",
        "[routing.aliases]",
        "# Name a client asks for = the model served instead.",
    ]
    aliases = list(Alias.objects.all())
    for alias in sorted(aliases, key=lambda a: a.name):
        if not alias.is_pattern:
            lines.append(f"{format_string(alias.name)} = {format_string(alias.target)}")
    patterns = sorted(
        (a for a in aliases if a.is_pattern), key=lambda a: (-len(a.name), a.name)
    )
    if patterns:
        lines += [
            "# Patterns (* any characters, ? one): for names no backend serves and",
            "# no alias above names, the longest pattern first.",
        ]
    for alias in patterns:
        lines.append(f"{format_string(alias.name)} = {format_string(alias.target)}")

    lines += [
        "",
        "[routing.fallbacks]",
        "# Model = models to try, in order, when it cannot be served.",
    ]
    chains = sorted(
        FallbackChain.objects.prefetch_related("steps"), key=lambda c: c.model
    )
    for chain in chains:
        fallbacks = ", ".join(format_string(name) for name in chain.fallback_models)
        lines.append(f"{format_string(chain.model)} = [{fallbacks}]")

    lines += export_traffic()

    lines += [
        "",
        "[cache]",
        "# The exact response cache and prompt caching (docs/caching.md).",
    ]
    lines += _settings(policy, CACHE_SETTINGS)

    backends = sorted(
        # Relay workers' backends come from their connections, not the file.
        Backend.objects.filter(is_demo=False)
        .exclude(kind=BackendKind.RELAY)
        .prefetch_related("models"),
        key=lambda b: (b.priority, b.name),
    )
    for backend in backends:
        lines += ["", "[[backends]]"]
        lines += _settings(backend, BACKEND_SETTINGS)
        if backend.has_api_key:
            lines.append(API_KEY_NOTE.rstrip("\n"))
        for model in sorted(backend.models.all(), key=lambda m: m.name):
            lines += ["", "[[backends.models]]"]
            lines += _settings(model, MODEL_SETTINGS)

    lines += [
        "",
        "[prices]",
        "# USD per million tokens, in and out (cached_input: read from a prompt",
        "# cache, cache_write: written to one; left out: the input price);",
        "# names or globs.",
    ]
    for price in ModelPrice.objects.order_by("model"):
        values = [
            f"input = {format_scalar(float(price.input_per_million))}",
            f"output = {format_scalar(float(price.output_per_million))}",
        ]
        for name, value in (
            ("cached_input", price.cached_input_per_million),
            ("cache_write", price.cache_write_per_million),
        ):
            if value is not None:
                values.append(f"{name} = {format_scalar(float(value))}")
        if price.cache_hit_per_million:
            cache_hit = format_scalar(float(price.cache_hit_per_million))
            values.append(f"cache_hit = {cache_hit}")
        if price.batch_price_factor != 1:
            factor = format_scalar(float(price.batch_price_factor))
            values.append(f"batch_factor = {factor}")
        lines.append(f"{format_string(price.model)} = {{ {', '.join(values)} }}")
    teams = list(Team.objects.order_by("name"))
    if teams:
        lines += ["", TEAMS_NOTE.rstrip("\n")]
    for team in teams:
        lines += ["[[teams]]"]
        lines += _settings(team, TEAM_SETTINGS)
        if team.budget_usd is not None:
            lines.append(f"budget_usd = {format_scalar(float(team.budget_usd))}")
        lines.append("")
    defaults = {s.field: get_field_default(ApiKey, s.field) for s in KEY_SETTINGS}
    keys = [
        key
        for key in ApiKey.objects.active()
        .select_related("team")
        .order_by("name", "created_at")
        if key.team is not None
        or key.allowed_models
        or key.expires_at is not None
        or key.budget_usd is not None
        or any(
            getattr(key, s.field) != defaults[s.field]
            for s in KEY_SETTINGS
            if s.field != "name"
        )
    ]
    if keys:
        lines += ["", KEYS_NOTE.rstrip("\n")]
    for key in keys:
        lines += ["[[keys]]"]
        lines += _settings(key, KEY_SETTINGS)
        if key.model_patterns:
            models = ", ".join(format_string(p) for p in key.model_patterns)
            lines.append(f"models = [{models}]")
        if key.expires_at is not None:
            lines.append(f"expires = {key.expires_at.astimezone(UTC).isoformat()}")
        if key.budget_usd is not None:
            lines.append(f"budget_usd = {format_scalar(float(key.budget_usd))}")
        if key.team is not None:
            lines.append(f"team = {format_string(key.team.name)}")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _settings(instance: object, settings: tuple[Setting, ...]) -> list[str]:
    # Keys whose value is empty (no concurrency limit, unknown context length)
    # are left out, which is how the file says "none"; an unknown capability
    # is written as "auto", so that the file shows it.
    lines = []
    for setting in settings:
        value = getattr(instance, setting.field)
        if value is None and setting.allows_auto:
            value = AUTO
        if value is not None:
            lines.append(f"{format_key(setting.key)} = {format_scalar(value)}")
    return lines
