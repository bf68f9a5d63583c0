"""Read a TOML document into configuration entries, noting every shape problem.

Reading checks the shape of the file: known tables and keys, value types,
required keys, duplicate names and where each API key comes from. Rules about
the values themselves (URL form, ranges, choices, single-level aliases, weights
summing to 100) belong to the models' ``clean()`` methods, which the importer
runs.
"""

from __future__ import annotations

import datetime
import difflib
import math
import tomllib
from collections.abc import Collection, Mapping
from decimal import Decimal
from typing import Any

from backends.models import Backend, BackendKind, BackendModel
from routing.config_file.literals import format_key, format_scalar, format_string
from routing.config_file.problems import ConfigError
from routing.config_file.schema import (
    ADMISSION_KEYS,
    ADMISSION_MODEL_TABLES,
    ADMISSION_SETTINGS,
    AUTO,
    BACKEND_KEYS,
    BACKEND_SETTINGS,
    FLEET_TOML_SETTINGS,
    KEY_BUDGET_USD,
    KEY_EXPIRES,
    KEY_KEYS,
    KEY_MODELS,
    KEY_SETTINGS,
    MODEL_KEYS,
    MODEL_SETTINGS,
    POLICY_SETTINGS,
    PRICE_KEYS,
    ROUTING_KEYS,
    WEIGHT_SETTINGS,
    AliasEntry,
    BackendEntry,
    ChainEntry,
    ConfigFile,
    KeyEntry,
    ModelEntry,
    PriceEntry,
    Setting,
    get_field_default,
)
from usage.models import ApiKey

SYNTAX_POSITION = " (at line "
END_OF_DOCUMENT = " (at end of document)"
MAX_SHOWN_VALUE = 60
NUL_MESSAGE = "contains a NUL character (\\u0000), which cannot be stored; remove it"


def read_config(text: str, source: str, environ: Mapping[str, str]) -> ConfigFile:
    """Parse a configuration file; its ``problems`` list whatever is wrong in it.

    Raise ConfigError if the text is not TOML at all. ``environ`` supplies the
    variables that ``api_key_env`` keys name.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(source, [_describe_syntax_error(error)]) from None
    return _Reader(environ).read_document(data)


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


class _Reader:
    """Walks the parsed document, collecting entries and problems."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.problems: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def read_document(self, data: dict[str, Any]) -> ConfigFile:
        self._reject_nul_characters(data, "")
        self._reject_unknown_keys(data, "", ("routing", "backends", "keys", "prices"))
        policy: dict[str, Any] = {}
        policy_invalid: set[str] = set()
        aliases: tuple[AliasEntry, ...] = ()
        fallbacks: tuple[ChainEntry, ...] = ()
        routing = self._read_table(data.get("routing"), "routing")
        if routing is not None:
            self._reject_unknown_keys(routing, "routing", ROUTING_KEYS)
            policy, policy_invalid = self._read_settings(
                routing, "routing", POLICY_SETTINGS
            )
            for key, settings in (
                ("weights", WEIGHT_SETTINGS),
                ("fleet", FLEET_TOML_SETTINGS),
            ):
                values, invalid = self._read_settings_table(routing, key, settings)
                policy |= values
                policy_invalid |= invalid
            admission_values, admission_invalid = self._read_admission(
                routing.get("admission")
            )
            policy |= admission_values
            policy_invalid |= admission_invalid
            aliases = self._read_aliases(routing.get("aliases"))
            fallbacks = self._read_fallbacks(routing.get("fallbacks"))
        backends = self._read_backends(data.get("backends"))
        return ConfigFile(
            policy=policy,
            aliases=aliases,
            fallbacks=fallbacks,
            backends=backends,
            keys=self._read_keys(data.get("keys")),
            prices=self._read_prices(data.get("prices")),
            policy_invalid=frozenset(policy_invalid),
            problems=tuple(self.problems),
        )

    def _reject_nul_characters(self, value: object, path: str) -> None:
        """Report every key or string holding NUL (TOML's \\u0000).

        The database cannot store it (PostgreSQL text refuses it outright).
        """
        if isinstance(value, dict):
            for key, item in value.items():
                item_path = _join(path, key.replace("\x00", "\\u0000"))
                if "\x00" in key:
                    self.add(item_path, NUL_MESSAGE)
                self._reject_nul_characters(item, item_path)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                self._reject_nul_characters(item, f"{path}[{index}]")
        elif isinstance(value, str) and "\x00" in value:
            self.add(path, NUL_MESSAGE)

    def _read_table(self, value: object, path: str) -> dict[str, Any] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            self.add(path, f"expected a table ([{path}]), got {_describe(value)}")
            return None
        return value

    def _read_array_of_tables(
        self, value: object, path: str, header: str
    ) -> list[dict[str, Any]]:
        if value is None:
            return []
        if not _is_array_of_tables(value):
            self.add(
                path,
                f"expected an array of tables ([[{header}]] sections), "
                f"got {_describe(value)}",
            )
            return []
        return value  # type: ignore[return-value]

    def _reject_unknown_keys(
        self, table: dict[str, Any], path: str, known: Collection[str]
    ) -> None:
        for key, value in table.items():
            if key in known:
                continue
            is_table = isinstance(value, dict) or (value and _is_array_of_tables(value))
            what = "table" if is_table else "key"
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = (
                f'did you mean "{close[0]}"?'
                if close
                else "expected one of " + ", ".join(known)
            )
            # The value is not shown: a misspelt api_key would be a secret.
            self.add(_join(path, key), f"unknown {what}; {hint}")

    def _read_settings(
        self, table: dict[str, Any], path: str, settings: tuple[Setting, ...]
    ) -> tuple[dict[str, Any], set[str]]:
        """Return the values of the settings given, and the fields given wrongly."""
        values: dict[str, Any] = {}
        invalid: set[str] = set()
        for setting in settings:
            if setting.key not in table:
                if setting.required:
                    self.add(path, f'missing required key "{setting.key}"')
                    invalid.add(setting.field)
                continue
            raw = table[setting.key]
            if setting.allows_auto and raw == AUTO:
                values[setting.field] = None
                continue
            value = _coerce(raw, setting.value_type)
            if value is None:
                self.add(
                    _join(path, setting.key),
                    f"expected {setting.expected}, got {_describe(raw)}",
                )
                invalid.add(setting.field)
            else:
                values[setting.field] = value
        return values, invalid

    def _read_settings_table(
        self, routing: dict[str, Any], key: str, settings: tuple[Setting, ...]
    ) -> tuple[dict[str, Any], set[str]]:
        """Read ``[routing.<key>]``, a table of scalar settings only."""
        path = f"routing.{key}"
        table = self._read_table(routing.get(key), path)
        if table is None:
            return {}, set()
        self._reject_unknown_keys(table, path, [s.key for s in settings])
        return self._read_settings(table, path, settings)

    def _read_admission(self, value: object) -> tuple[dict[str, Any], set[str]]:
        path = "routing.admission"
        table = self._read_table(value, path)
        if table is None:
            return {}, set()
        self._reject_unknown_keys(table, path, ADMISSION_KEYS)
        values, invalid = self._read_settings(table, path, ADMISSION_SETTINGS)
        for key, field, kind, expected in ADMISSION_MODEL_TABLES:
            models = self._read_model_numbers(
                table, f"{path}.{key}", key, kind, expected
            )
            if models is None:
                invalid.add(field)
            elif key in table:
                values[field] = models
        return values, invalid

    def _read_model_numbers(
        self, table: dict[str, Any], path: str, key: str, kind: type, expected: str
    ) -> dict[str, object] | None:
        """A table of model name = number, or None if it is not one."""
        models = self._read_table(table.get(key), path)
        if models is None:
            return None if key in table else {}
        clean: dict[str, object] = {}
        valid = True
        for model, raw in models.items():
            number = _coerce(raw, kind)
            if number is None:
                self.add(
                    f"{path}.{format_key(model)}",
                    f"expected {expected}, got {_describe(raw)}",
                )
                valid = False
            else:
                clean[model.strip()] = number
        return clean if valid else None

    def _read_aliases(self, value: object) -> tuple[AliasEntry, ...]:
        table = self._read_table(value, "routing.aliases")
        if table is None:
            return ()
        entries = []
        seen: dict[str, str] = {}
        for raw_name, target in table.items():
            path = f"routing.aliases.{format_string(raw_name)}"
            name = raw_name.strip()
            if not self._is_first(name, path, seen, "alias"):
                continue
            if not isinstance(target, str):
                self.add(path, f"expected a model name, got {_describe(target)}")
                continue
            entries.append(AliasEntry(path=path, name=name, target=target))
        return tuple(entries)

    def _read_fallbacks(self, value: object) -> tuple[ChainEntry, ...]:
        table = self._read_table(value, "routing.fallbacks")
        if table is None:
            return ()
        entries = []
        seen: dict[str, str] = {}
        for raw_model, fallbacks in table.items():
            path = f"routing.fallbacks.{format_string(raw_model)}"
            model = raw_model.strip()
            if not self._is_first(model, path, seen, "fallback chain"):
                continue
            if not isinstance(fallbacks, list):
                self.add(
                    path,
                    f"expected an array of model names, got {_describe(fallbacks)}",
                )
                continue
            entries.append(
                ChainEntry(
                    path=path,
                    model=model,
                    fallbacks=self._read_fallback_list(fallbacks, path),
                )
            )
        return tuple(entries)

    def _read_fallback_list(self, items: list[Any], path: str) -> tuple[str, ...]:
        positions: dict[str, int] = {}
        for index, item in enumerate(items):
            item_path = f"{path}[{index}]"
            if not isinstance(item, str):
                self.add(item_path, f"expected a model name, got {_describe(item)}")
                continue
            name = item.strip()
            if name in positions:
                self.add(
                    item_path,
                    f"{format_string(name)} is already listed at "
                    f"[{positions[name]}]; list each fallback once",
                )
                continue
            positions[name] = index
        return tuple(positions)

    def _read_backends(self, value: object) -> tuple[BackendEntry, ...]:
        entries = []
        seen: dict[str, str] = {}
        tables = self._read_array_of_tables(value, "backends", "backends")
        for index, table in enumerate(tables):
            path = _entry_path(f"backends[{index}]", table.get("name"))
            self._reject_unknown_keys(table, path, BACKEND_KEYS)
            values, invalid = self._read_settings(table, path, BACKEND_SETTINGS)
            api_key = self._read_api_key(table, path, invalid)
            models = self._read_models(table.get("models"), path)
            if "name" not in values:
                continue
            if values.get("kind") == BackendKind.RELAY:
                self.add(
                    f"{path}.kind",
                    '"relay" backends are workers that dial in; create one with '
                    "nexus_create_worker (or the admin), not in this file",
                )
                continue
            name = values.pop("name").strip()
            if self._is_first(name, f"{path}.name", seen, "backend name"):
                entries.append(
                    BackendEntry(
                        path=path,
                        name=name,
                        values=_with_defaults(Backend, BACKEND_SETTINGS, values),
                        models=models,
                        invalid=frozenset(invalid),
                        api_key=api_key,
                    )
                )
        return tuple(entries)

    def _read_models(self, value: object, backend_path: str) -> tuple[ModelEntry, ...]:
        entries = []
        seen: dict[str, str] = {}
        path = f"{backend_path}.models"
        for index, table in enumerate(
            self._read_array_of_tables(value, path, "backends.models")
        ):
            model_path = _entry_path(f"{path}[{index}]", table.get("name"))
            self._reject_unknown_keys(table, model_path, MODEL_KEYS)
            values, invalid = self._read_settings(table, model_path, MODEL_SETTINGS)
            if "name" not in values:
                continue
            name = values.pop("name").strip()
            if self._is_first(name, f"{model_path}.name", seen, "model name"):
                entries.append(
                    ModelEntry(
                        path=model_path,
                        name=name,
                        values=_with_defaults(BackendModel, MODEL_SETTINGS, values),
                        invalid=frozenset(invalid),
                    )
                )
        return tuple(entries)

    def _read_keys(self, value: object) -> tuple[KeyEntry, ...]:
        entries = []
        seen: dict[str, str] = {}
        for index, table in enumerate(
            self._read_array_of_tables(value, "keys", "keys")
        ):
            path = _entry_path(f"keys[{index}]", table.get("name"))
            self._reject_unknown_keys(table, path, KEY_KEYS)
            values, invalid = self._read_settings(table, path, KEY_SETTINGS)
            if KEY_MODELS in table:
                models = table[KEY_MODELS]
                if isinstance(models, list) and all(isinstance(m, str) for m in models):
                    values["allowed_models"] = ",".join(m.strip() for m in models)
                else:
                    self.add(
                        _join(path, KEY_MODELS),
                        "expected an array of model names or glob patterns, got "
                        + _describe(models),
                    )
                    invalid.add("allowed_models")
            if KEY_EXPIRES in table:
                expires = _moment(table[KEY_EXPIRES])
                if expires is None:
                    self.add(
                        _join(path, KEY_EXPIRES),
                        "expected a date (2027-01-31) or a date-time with its "
                        "offset (2027-01-31T18:00:00Z), got "
                        + _describe(table[KEY_EXPIRES]),
                    )
                    invalid.add("expires_at")
                else:
                    values["expires_at"] = expires
            if KEY_BUDGET_USD in table:
                usd = _coerce(table[KEY_BUDGET_USD], float)
                if usd is None:
                    self.add(
                        _join(path, KEY_BUDGET_USD),
                        "expected a number of USD, got "
                        + _describe(table[KEY_BUDGET_USD]),
                    )
                    invalid.add("budget_usd")
                else:
                    values["budget_usd"] = Decimal(str(usd))
            if "name" not in values:
                continue
            name = values.pop("name").strip()
            if self._is_first(name, f"{path}.name", seen, "key name"):
                defaults = {
                    field: get_field_default(ApiKey, field) for field in _KEY_FIELDS
                }
                entries.append(
                    KeyEntry(path, name, defaults | values, frozenset(invalid))
                )
        return tuple(entries)

    def _read_prices(self, value: object) -> tuple[PriceEntry, ...]:
        table = self._read_table(value, "prices")
        if table is None:
            return ()
        entries = []
        for model, price in table.items():
            path = f"prices.{format_key(model)}"
            if not isinstance(price, dict):
                self.add(
                    path,
                    "expected { input = USD, output = USD } per million tokens, "
                    f"got {_describe(price)}",
                )
                continue
            self._reject_unknown_keys(price, path, PRICE_KEYS)
            values: dict[str, Any] = {}
            invalid: set[str] = set()
            for key, field in (
                ("input", "input_per_million"),
                ("output", "output_per_million"),
            ):
                if key not in price:
                    continue
                number = _coerce(price[key], float)
                if number is None:
                    self.add(
                        f"{path}.{key}",
                        "expected a number of USD per million tokens, got "
                        + _describe(price[key]),
                    )
                    invalid.add(field)
                else:
                    values[field] = Decimal(str(number))
            defaults = {
                "input_per_million": Decimal(0),
                "output_per_million": Decimal(0),
            }
            entries.append(
                PriceEntry(path, model.strip(), defaults | values, frozenset(invalid))
            )
        return tuple(entries)

    def _read_api_key(
        self, table: dict[str, Any], path: str, invalid: set[str]
    ) -> str | None:
        """Return the key the entry gives, or None when it gives none."""
        if "api_key" in table and "api_key_env" in table:
            self.add(path, "give api_key or api_key_env, not both")
        elif "api_key" in table:
            raw = table["api_key"]
            if isinstance(raw, str):
                return raw.strip()
            # Only the type is named: the value is (meant to be) a secret.
            self.add(
                f"{path}.api_key",
                f"expected a string, got {_describe(raw, secret=True)}",
            )
        elif "api_key_env" in table:
            return self._read_api_key_env(table["api_key_env"], path, invalid)
        else:
            return None
        invalid.add("api_key")
        return None

    def _read_api_key_env(
        self, variable: object, path: str, invalid: set[str]
    ) -> str | None:
        key_path = f"{path}.api_key_env"
        if not isinstance(variable, str) or not variable.strip():
            self.add(
                key_path,
                "expected the name of an environment variable, "
                f"got {_describe(variable)}",
            )
        elif variable.strip() not in self.environ:
            self.add(key_path, f"environment variable {variable.strip()} is not set")
        elif not (value := self.environ[variable.strip()].strip()):
            self.add(key_path, f"environment variable {variable.strip()} is empty")
        else:
            return value
        invalid.add("api_key")
        return None

    def _is_first(self, name: str, path: str, seen: dict[str, str], what: str) -> bool:
        """Record ``name``; report it and return False if an earlier entry had it."""
        if name in seen:
            self.add(
                path, f"duplicate {what} {format_string(name)} (also at {seen[name]})"
            )
            return False
        seen[name] = path
        return True


def _with_defaults(
    model: type[Backend | BackendModel],
    settings: tuple[Setting, ...],
    values: dict[str, Any],
) -> dict[str, Any]:
    # A key the entry leaves out means the field's default, so that importing
    # a file sets every row it mentions to exactly what the file says.
    complete = {
        s.field: get_field_default(model, s.field)
        for s in settings
        if s.field != "name"
    }
    return complete | values


_KEY_FIELDS = (
    *(s.field for s in KEY_SETTINGS if s.field != "name"),
    "allowed_models",
    "expires_at",
    "budget_usd",
)


def _moment(value: object) -> datetime.datetime | None:
    """A TOML date (midnight UTC) or offset date-time; None for anything else."""
    if isinstance(value, datetime.datetime):
        return value if value.tzinfo is not None else None
    if isinstance(value, datetime.date):
        return datetime.datetime.combine(value, datetime.time(), datetime.UTC)
    return None


def _coerce(value: object, value_type: type) -> object | None:
    """Return ``value`` as ``value_type``, or None if it is not one."""
    # type() rather than isinstance(): bool is a subclass of int, and
    # ``priority = true`` is a mistake, not a 1.
    if value_type is float:
        if type(value) in (int, float) and math.isfinite(value):  # type: ignore[arg-type]
            return float(value)  # type: ignore[arg-type]
        return None
    return value if type(value) is value_type else None


def _describe(value: object, *, secret: bool = False) -> str:
    """Name a value for a message: the value itself, or only its type."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, datetime.date | datetime.time):
        return "a date or time"
    if secret or not isinstance(value, str | bool | int | float):
        return {str: "a string", bool: "a boolean", int: "an integer"}.get(
            type(value), "a number"
        )
    shown = format_scalar(value)
    if len(shown) > MAX_SHOWN_VALUE:
        shown = shown[: MAX_SHOWN_VALUE - 4] + '..."'
    return shown


def _is_array_of_tables(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def _join(path: str, key: str) -> str:
    return f"{path}.{format_key(key)}" if path else format_key(key)


def _entry_path(path: str, name: object) -> str:
    """Name an array entry by index, plus its name when it has a usable one."""
    if isinstance(name, str) and name.strip():
        return f"{path} ({format_string(name.strip())})"
    return path
