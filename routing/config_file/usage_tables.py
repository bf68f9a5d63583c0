"""Read the ``[[keys]]``, ``[[teams]]`` and ``[prices]`` tables: usage rows.

A key entry gives an API key's name, limits, the models it may use (names or
glob patterns), when it expires (a date, or a date-time with its offset) and
its budget in USD; the fields it leaves out get ``ApiKey``'s defaults. A price
entry gives a model's input and output price in USD per million tokens.
"""

from __future__ import annotations

import datetime
from decimal import Decimal
from typing import Any

from routing.config_file.literals import format_key
from routing.config_file.schema import (
    KEY_BUDGET_USD,
    KEY_EXPIRES,
    KEY_KEYS,
    KEY_MODELS,
    KEY_SETTINGS,
    KEY_TEAM,
    PRICE_KEYS,
    TEAM_KEY_FOR_FIELD,
    TEAM_KEYS,
    TEAM_SETTINGS,
    KeyEntry,
    PriceEntry,
    TeamEntry,
    get_field_default,
)
from routing.config_file.values import (
    ValueReader,
    coerce,
    describe,
    format_entry_path,
    join_path,
)
from usage.models import ApiKey, Team


def read_keys(reader: ValueReader, value: object) -> tuple[KeyEntry, ...]:
    """Read ``[[keys]]``; an entry without a usable name is left out."""
    entries = []
    seen: dict[str, str] = {}
    for index, table in enumerate(reader.read_array_of_tables(value, "keys", "keys")):
        path = format_entry_path(f"keys[{index}]", table.get("name"))
        reader.reject_unknown_keys(table, path, KEY_KEYS)
        values, invalid = reader.read_settings(table, path, KEY_SETTINGS)
        if KEY_MODELS in table:
            models = table[KEY_MODELS]
            if isinstance(models, list) and all(isinstance(m, str) for m in models):
                values["allowed_models"] = ",".join(m.strip() for m in models)
            else:
                reader.add(
                    join_path(path, KEY_MODELS),
                    "expected an array of model names or glob patterns, got "
                    + describe(models),
                )
                invalid.add("allowed_models")
        if KEY_EXPIRES in table:
            expires = _moment(table[KEY_EXPIRES])
            if expires is None:
                reader.add(
                    join_path(path, KEY_EXPIRES),
                    "expected a date (2027-01-31) or a date-time with its "
                    "offset (2027-01-31T18:00:00Z), got "
                    + describe(table[KEY_EXPIRES]),
                )
                invalid.add("expires_at")
            else:
                values["expires_at"] = expires
        _read_usd(reader, table, path, values, invalid)
        if KEY_TEAM in table:
            team = table[KEY_TEAM]
            if isinstance(team, str) and team.strip():
                # A name: the importer finds the team (or the file's own).
                values["team"] = team.strip()
            else:
                reader.add(
                    join_path(path, KEY_TEAM),
                    "expected a team's name, got " + describe(team),
                )
                invalid.add("team")
        if "name" not in values:
            continue
        name = values.pop("name").strip()
        if reader.is_first(name, f"{path}.name", seen, "key name"):
            entries.append(
                KeyEntry(path, name, default_key_values() | values, frozenset(invalid))
            )
    return tuple(entries)


def read_teams(reader: ValueReader, value: object) -> tuple[TeamEntry, ...]:
    """Read ``[[teams]]``; an entry without a usable name is left out."""
    entries = []
    seen: dict[str, str] = {}
    for index, table in enumerate(reader.read_array_of_tables(value, "teams", "teams")):
        path = format_entry_path(f"teams[{index}]", table.get("name"))
        reader.reject_unknown_keys(table, path, TEAM_KEYS)
        values, invalid = reader.read_settings(table, path, TEAM_SETTINGS)
        _read_usd(reader, table, path, values, invalid)
        if "name" not in values:
            continue
        name = values.pop("name").strip()
        if reader.is_first(name, f"{path}.name", seen, "team name"):
            defaults = {
                field: get_field_default(Team, field)
                for field in TEAM_KEY_FOR_FIELD
                if field != "name"
            }
            entries.append(TeamEntry(path, name, defaults | values, frozenset(invalid)))
    return tuple(entries)


def _read_usd(
    reader: ValueReader,
    table: dict[str, Any],
    path: str,
    values: dict[str, Any],
    invalid: set[str],
) -> None:
    """Read a ``budget_usd`` (a key's or a team's) into ``values``."""
    if KEY_BUDGET_USD not in table:
        return
    usd = coerce(table[KEY_BUDGET_USD], float)
    if usd is None:
        reader.add(
            join_path(path, KEY_BUDGET_USD),
            "expected a number of USD, got " + describe(table[KEY_BUDGET_USD]),
        )
        invalid.add("budget_usd")
    else:
        values["budget_usd"] = Decimal(str(usd))


def default_key_values() -> dict[str, Any]:
    """What a ``[[keys]]`` entry that gives nothing but a name sets: no limit."""
    return {field: get_field_default(ApiKey, field) for field in _KEY_FIELDS}


def read_prices(reader: ValueReader, value: object) -> tuple[PriceEntry, ...]:
    """Read ``[prices]``, a table of model name = { input, output, cached_input,
    cache_write }."""
    table = reader.read_table(value, "prices")
    if table is None:
        return ()
    entries = []
    for model, price in table.items():
        path = f"prices.{format_key(model)}"
        if not isinstance(price, dict):
            reader.add(
                path,
                "expected { input = USD, output = USD } per million tokens, "
                f"got {describe(price)}",
            )
            continue
        reader.reject_unknown_keys(price, path, PRICE_KEYS)
        values: dict[str, Any] = {}
        invalid: set[str] = set()
        for key, field in (
            ("input", "input_per_million"),
            ("output", "output_per_million"),
            ("cached_input", "cached_input_per_million"),
            ("cache_write", "cache_write_per_million"),
            ("cache_hit", "cache_hit_per_million"),
            ("batch_factor", "batch_price_factor"),
        ):
            if key not in price:
                continue
            number = coerce(price[key], float)
            if number is None:
                expected = (
                    "a fraction of the price"
                    if key == "batch_factor"
                    else "a number of USD per million tokens"
                )
                reader.add(
                    f"{path}.{key}", f"expected {expected}, got {describe(price[key])}"
                )
                invalid.add(field)
            else:
                values[field] = Decimal(str(number))
        defaults = {
            "input_per_million": Decimal(0),
            "output_per_million": Decimal(0),
            # None: cached and cache-written tokens cost the input price.
            "cached_input_per_million": None,
            "cache_write_per_million": None,
            "cache_hit_per_million": Decimal(0),
            "batch_price_factor": Decimal(1),
        }
        entries.append(
            PriceEntry(path, model.strip(), defaults | values, frozenset(invalid))
        )
    return tuple(entries)


_KEY_FIELDS = (
    *(s.field for s in KEY_SETTINGS if s.field != "name"),
    "allowed_models",
    "expires_at",
    "budget_usd",
    "team",
)


def _moment(value: object) -> datetime.datetime | None:
    """A TOML date (midnight UTC) or offset date-time; None for anything else."""
    if isinstance(value, datetime.datetime):
        return value if value.tzinfo is not None else None
    if isinstance(value, datetime.date):
        return datetime.datetime.combine(value, datetime.time(), datetime.UTC)
    return None
