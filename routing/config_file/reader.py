"""Read a TOML document into configuration entries, noting every shape problem.

Reading checks the shape of the file: known tables and keys, value types,
required keys, duplicate names and where each API key comes from. Rules about
the values themselves (URL form, ranges, choices, single-level aliases, weights
summing to 100) belong to the models' ``clean()`` methods, which the importer
runs.

This module reads the document's top level and the ``[routing]`` table (policy
settings, weights, fleet, admission, aliases, fallback chains);
``backend_tables`` reads ``[[backends]]``, ``usage_tables`` reads ``[[keys]]``
and ``[prices]``, and ``values`` holds what they all share.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from typing import Any

from routing.config_file.backend_tables import read_backends
from routing.config_file.literals import format_key, format_string
from routing.config_file.problems import ConfigError
from routing.config_file.schema import (
    ADMISSION_KEYS,
    ADMISSION_MODEL_TABLES,
    ADMISSION_SETTINGS,
    CACHE_SETTINGS,
    CONTEXT_SHIFT_SETTINGS,
    ENSEMBLE_SETTINGS,
    FLEET_TOML_SETTINGS,
    HEDGE_SETTINGS,
    POLICY_SETTINGS,
    PREFIX_SETTINGS,
    ROUTING_KEYS,
    SHADOW_SETTINGS,
    WEIGHT_SETTINGS,
    AliasEntry,
    ChainEntry,
    ConfigFile,
    Setting,
)
from routing.config_file.traffic_tables import read_model_tables, read_splits
from routing.config_file.usage_tables import read_keys, read_prices, read_teams
from routing.config_file.values import ValueReader, coerce, describe
from routing.core.aliases import check_alias_pattern, is_alias_pattern

SYNTAX_POSITION = " (at line "
END_OF_DOCUMENT = " (at end of document)"


def read_config(text: str, source: str, environ: Mapping[str, str]) -> ConfigFile:
    """Parse a configuration file; its ``problems`` list whatever is wrong in it.

    Raise ConfigError if the text is not TOML at all. ``environ`` supplies the
    variables that ``api_key_env`` keys name.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(source, [_describe_syntax_error(error)]) from None
    except RecursionError:
        # No Nexus setting nests more than a few levels deep.
        raise ConfigError(source, ["arrays or tables nested too deeply"]) from None
    return _read_document(ValueReader(environ), data)


def _describe_syntax_error(error: tomllib.TOMLDecodeError) -> str:
    # Python 3.11's TOMLDecodeError has no lineno attribute; the position is
    # only in the message, as "... (at line 3, column 5)".
    message = str(error)
    if message.endswith(END_OF_DOCUMENT):
        reason = message.removesuffix(END_OF_DOCUMENT)
        return f"invalid TOML at the end of the file: {reason}"
    reason, found, position = message.rpartition(SYNTAX_POSITION)
    if found:
        return f"invalid TOML at line {position.rstrip(')')}: {reason}"
    return f"invalid TOML: {message}"


def _read_document(reader: ValueReader, data: dict[str, Any]) -> ConfigFile:
    """Read every table of the parsed document, in the order problems are listed."""
    reader.reject_nul_characters(data, "")
    reader.reject_unknown_keys(
        data, "", ("routing", "cache", "backends", "keys", "teams", "prices")
    )
    policy: dict[str, Any] = {}
    policy_invalid: set[str] = set()
    aliases: tuple[AliasEntry, ...] = ()
    fallbacks: tuple[ChainEntry, ...] = ()
    traffic: dict[str, Any] = {}
    routing = reader.read_table(data.get("routing"), "routing")
    if routing is not None:
        reader.reject_unknown_keys(routing, "routing", ROUTING_KEYS)
        policy, policy_invalid = reader.read_settings(
            routing, "routing", POLICY_SETTINGS
        )
        for key, settings in (
            ("weights", WEIGHT_SETTINGS),
            ("fleet", FLEET_TOML_SETTINGS),
            ("context_shift", CONTEXT_SHIFT_SETTINGS),
            ("ensemble", ENSEMBLE_SETTINGS),
            ("prefix", PREFIX_SETTINGS),
        ):
            values, invalid = _read_settings_table(reader, routing, key, settings)
            policy |= values
            policy_invalid |= invalid
        admission_values, admission_invalid = _read_admission(
            reader, routing.get("admission")
        )
        policy |= admission_values
        policy_invalid |= admission_invalid
        aliases = _read_aliases(reader, routing.get("aliases"))
        fallbacks = _read_fallbacks(reader, routing.get("fallbacks"))
        traffic = {
            "splits": read_splits(reader, routing.get("splits")),
            "shadows": read_model_tables(
                reader, routing.get("shadows"), "routing.shadows", SHADOW_SETTINGS
            ),
            "hedging": read_model_tables(
                reader, routing.get("hedging"), "routing.hedging", HEDGE_SETTINGS
            ),
        }
    cache, cache_invalid = _read_settings_table(reader, data, "cache", CACHE_SETTINGS)
    policy |= cache
    policy_invalid |= cache_invalid
    backends = read_backends(reader, data.get("backends"))
    return ConfigFile(
        policy=policy,
        aliases=aliases,
        fallbacks=fallbacks,
        backends=backends,
        keys=read_keys(reader, data.get("keys")),
        teams=read_teams(reader, data.get("teams")),
        prices=read_prices(reader, data.get("prices")),
        **traffic,
        policy_invalid=frozenset(policy_invalid),
        problems=tuple(reader.problems),
        warnings=tuple(reader.warnings),
    )


def _read_settings_table(
    reader: ValueReader,
    routing: dict[str, Any],
    key: str,
    settings: tuple[Setting, ...],
) -> tuple[dict[str, Any], set[str]]:
    """Read ``[routing.<key>]`` (``[cache]``: the top level's), a table of
    scalar settings only."""
    path = key if key == "cache" else f"routing.{key}"
    table = reader.read_table(routing.get(key), path)
    if table is None:
        return {}, set()
    reader.reject_unknown_keys(table, path, [s.key for s in settings])
    return reader.read_settings(table, path, settings)


def _read_admission(
    reader: ValueReader, value: object
) -> tuple[dict[str, Any], set[str]]:
    path = "routing.admission"
    table = reader.read_table(value, path)
    if table is None:
        return {}, set()
    reader.reject_unknown_keys(table, path, ADMISSION_KEYS)
    values, invalid = reader.read_settings(table, path, ADMISSION_SETTINGS)
    for key, field, kind, expected in ADMISSION_MODEL_TABLES:
        models = _read_model_numbers(
            reader, table, f"{path}.{key}", key, kind, expected
        )
        if models is None:
            invalid.add(field)
        elif key in table:
            values[field] = models
    return values, invalid


def _read_model_numbers(
    reader: ValueReader,
    table: dict[str, Any],
    path: str,
    key: str,
    kind: type,
    expected: str,
) -> dict[str, object] | None:
    """A table of model name = number, or None if it is not one."""
    models = reader.read_table(table.get(key), path)
    if models is None:
        return None if key in table else {}
    clean: dict[str, object] = {}
    valid = True
    for model, raw in models.items():
        number = coerce(raw, kind)
        if number is None:
            reader.add(
                f"{path}.{format_key(model)}",
                f"expected {expected}, got {describe(raw)}",
            )
            valid = False
        else:
            clean[model.strip()] = number
    return clean if valid else None


def _read_aliases(reader: ValueReader, value: object) -> tuple[AliasEntry, ...]:
    table = reader.read_table(value, "routing.aliases")
    if table is None:
        return ()
    entries = []
    seen: dict[str, str] = {}
    for raw_name, target in table.items():
        path = f"routing.aliases.{format_string(raw_name)}"
        name = raw_name.strip()
        if not reader.is_first(name, path, seen, "alias"):
            continue
        if not isinstance(target, str):
            reader.add(path, f"expected a model name, got {describe(target)}")
            continue
        if is_alias_pattern(name) and (why := check_alias_pattern(name)):
            reader.add(path, why)
            continue
        if is_alias_pattern(target):
            reader.add(
                path,
                f"the target {format_string(target)} is a pattern; it must be "
                "the one model name to serve instead",
            )
            continue
        entries.append(AliasEntry(path=path, name=name, target=target))
    return tuple(entries)


def _read_fallbacks(reader: ValueReader, value: object) -> tuple[ChainEntry, ...]:
    table = reader.read_table(value, "routing.fallbacks")
    if table is None:
        return ()
    entries = []
    seen: dict[str, str] = {}
    for raw_model, fallbacks in table.items():
        path = f"routing.fallbacks.{format_string(raw_model)}"
        model = raw_model.strip()
        if not reader.is_first(model, path, seen, "fallback chain"):
            continue
        if not isinstance(fallbacks, list):
            reader.add(
                path,
                f"expected an array of model names, got {describe(fallbacks)}",
            )
            continue
        entries.append(
            ChainEntry(
                path=path,
                model=model,
                fallbacks=_read_fallback_list(reader, fallbacks, path),
            )
        )
    return tuple(entries)


def _read_fallback_list(
    reader: ValueReader, items: list[Any], path: str
) -> tuple[str, ...]:
    positions: dict[str, int] = {}
    for index, item in enumerate(items):
        item_path = f"{path}[{index}]"
        if not isinstance(item, str):
            reader.add(item_path, f"expected a model name, got {describe(item)}")
            continue
        name = item.strip()
        if name in positions:
            reader.add(
                item_path,
                f"{format_string(name)} is already listed at "
                f"[{positions[name]}]; list each fallback once",
            )
            continue
        positions[name] = index
    return tuple(positions)
