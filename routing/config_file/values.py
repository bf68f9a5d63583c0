"""The readers that every table of the configuration file shares.

``ValueReader`` collects the problems found in a parsed document and reads the
shapes each table is built from: a table, an array of tables, its known keys
(suggesting the closest one for a misspelt key), typed settings and names given
once. The functions below coerce a TOML value to a setting's type and name a
bad value in a message without ever showing a secret.
"""

from __future__ import annotations

import datetime
import difflib
import math
from collections.abc import Collection, Mapping
from typing import Any

from routing.config_file.literals import format_key, format_scalar, format_string
from routing.config_file.schema import AUTO, Setting

MAX_SHOWN_VALUE = 60
NUL_MESSAGE = "contains a NUL character (\\u0000), which cannot be stored; remove it"


class ValueReader:
    """Collects the problems of a document, and reads the shapes tables share."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        # The variables that api_key_env keys name.
        self.environ = environ
        self.problems: list[str] = []
        # Not problems: the file imports, but the operator should know.
        self.warnings: list[str] = []

    def add(self, path: str, message: str) -> None:
        """Note a problem with the value at ``path``."""
        self.problems.append(f"{path}: {message}")

    def warn(self, path: str, message: str) -> None:
        """Note something about the value at ``path`` that does not stop the import."""
        self.warnings.append(f"{path}: {message}")

    def reject_nul_characters(self, value: object, path: str) -> None:
        """Report every key or string holding NUL (TOML's \\u0000).

        The database cannot store it (PostgreSQL text refuses it outright).
        """
        if isinstance(value, dict):
            for key, item in value.items():
                item_path = join_path(path, key.replace("\x00", "\\u0000"))
                if "\x00" in key:
                    self.add(item_path, NUL_MESSAGE)
                self.reject_nul_characters(item, item_path)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                self.reject_nul_characters(item, f"{path}[{index}]")
        elif isinstance(value, str) and "\x00" in value:
            self.add(path, NUL_MESSAGE)

    def read_table(self, value: object, path: str) -> dict[str, Any] | None:
        """Return ``value`` if it is a table; None if absent or (noted) not one."""
        if value is None:
            return None
        if not isinstance(value, dict):
            self.add(path, f"expected a table ([{path}]), got {describe(value)}")
            return None
        return value

    def read_array_of_tables(
        self, value: object, path: str, header: str
    ) -> list[dict[str, Any]]:
        """Return the tables of ``value``; none if absent or (noted) not an array."""
        if value is None:
            return []
        if not is_array_of_tables(value):
            self.add(
                path,
                f"expected an array of tables ([[{header}]] sections), "
                f"got {describe(value)}",
            )
            return []
        return value  # type: ignore[return-value]

    def reject_unknown_keys(
        self, table: dict[str, Any], path: str, known: Collection[str]
    ) -> None:
        """Note each key of ``table`` not in ``known``, with the closest one."""
        for key, value in table.items():
            if key in known:
                continue
            is_table = isinstance(value, dict) or (value and is_array_of_tables(value))
            what = "table" if is_table else "key"
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = (
                f'did you mean "{close[0]}"?'
                if close
                else "expected one of " + ", ".join(known)
            )
            # The value is not shown: a misspelt api_key would be a secret.
            self.add(join_path(path, key), f"unknown {what}; {hint}")

    def read_settings(
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
            value = coerce(raw, setting.value_type)
            if value is None:
                self.add(
                    join_path(path, setting.key),
                    f"expected {setting.expected}, got {describe(raw)}",
                )
                invalid.add(setting.field)
            else:
                values[setting.field] = value
        return values, invalid

    def is_first(self, name: str, path: str, seen: dict[str, str], what: str) -> bool:
        """Record ``name``; report it and return False if an earlier entry had it."""
        if name in seen:
            self.add(
                path, f"duplicate {what} {format_string(name)} (also at {seen[name]})"
            )
            return False
        seen[name] = path
        return True


def coerce(value: object, value_type: type) -> object | None:
    """Return ``value`` as ``value_type``, or None if it is not one."""
    # type() rather than isinstance(): bool is a subclass of int, and
    # ``priority = true`` is a mistake, not a 1.
    if value_type is float:
        if type(value) in (int, float) and math.isfinite(value):  # type: ignore[arg-type]
            return float(value)  # type: ignore[arg-type]
        return None
    return value if type(value) is value_type else None


def describe(value: object, *, secret: bool = False) -> str:
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


def is_array_of_tables(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def join_path(path: str, key: str) -> str:
    """Name ``key`` inside the table at ``path`` (quoted where TOML needs it)."""
    return f"{path}.{format_key(key)}" if path else format_key(key)


def format_entry_path(path: str, name: object) -> str:
    """Name an array entry by index, plus its name when it has a usable one."""
    if isinstance(name, str) and name.strip():
        return f"{path} ({format_string(name.strip())})"
    return path
