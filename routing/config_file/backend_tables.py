"""Read the ``[[backends]]`` tables and the ``[[backends.models]]`` in each.

Each backend entry gets every field the file leaves out at its default, so
that the import sets the row to exactly what the file says; its API key comes
from ``api_key`` or from the environment variable ``api_key_env`` names, and is
never shown in a message. A variable that is not set (or empty) is a problem for
an enabled backend: requests would go out without the key and fail upstream.
For a backend the file disables it is only a warning, and the entry keeps the
key it has: a disabled backend serves nothing, so a file that lists a cloud
backend for later (``nexus.example.toml``'s ``openai``) imports, and checks
with ``--dry-run``, on a machine without that key. Workers (``kind = "relay"``) are refused here: they
dial in and are created with ``nexus_create_worker``.
"""

from __future__ import annotations

from typing import Any

from backends.models import Backend, BackendKind, BackendModel
from routing.config_file.schema import (
    BACKEND_KEYS,
    BACKEND_SETTINGS,
    MODEL_KEYS,
    MODEL_SETTINGS,
    BackendEntry,
    ModelEntry,
    Setting,
    get_field_default,
)
from routing.config_file.values import ValueReader, describe, format_entry_path


def read_backends(reader: ValueReader, value: object) -> tuple[BackendEntry, ...]:
    """Read ``[[backends]]``; an entry without a usable name is left out."""
    entries = []
    seen: dict[str, str] = {}
    tables = reader.read_array_of_tables(value, "backends", "backends")
    for index, table in enumerate(tables):
        path = format_entry_path(f"backends[{index}]", table.get("name"))
        reader.reject_unknown_keys(table, path, BACKEND_KEYS)
        values, invalid = reader.read_settings(table, path, BACKEND_SETTINGS)
        enabled = values.get("enabled", True) is not False
        api_key = _read_api_key(reader, table, path, invalid, enabled=enabled)
        models = _read_models(reader, table.get("models"), path)
        if "name" not in values:
            continue
        if values.get("kind") == BackendKind.RELAY:
            reader.add(
                f"{path}.kind",
                '"relay" backends are workers that dial in; create one with '
                "nexus_create_worker (or the admin), not in this file",
            )
            continue
        name = values.pop("name").strip()
        if reader.is_first(name, f"{path}.name", seen, "backend name"):
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


def _read_models(
    reader: ValueReader, value: object, backend_path: str
) -> tuple[ModelEntry, ...]:
    entries = []
    seen: dict[str, str] = {}
    path = f"{backend_path}.models"
    for index, table in enumerate(
        reader.read_array_of_tables(value, path, "backends.models")
    ):
        model_path = format_entry_path(f"{path}[{index}]", table.get("name"))
        reader.reject_unknown_keys(table, model_path, MODEL_KEYS)
        values, invalid = reader.read_settings(table, model_path, MODEL_SETTINGS)
        if "name" not in values:
            continue
        name = values.pop("name").strip()
        if reader.is_first(name, f"{model_path}.name", seen, "model name"):
            entries.append(
                ModelEntry(
                    path=model_path,
                    name=name,
                    values=_with_defaults(BackendModel, MODEL_SETTINGS, values),
                    invalid=frozenset(invalid),
                )
            )
    return tuple(entries)


def _read_api_key(
    reader: ValueReader,
    table: dict[str, Any],
    path: str,
    invalid: set[str],
    *,
    enabled: bool,
) -> str | None:
    """Return the key the entry gives, or None when it gives none."""
    if "api_key" in table and "api_key_env" in table:
        reader.add(path, "give api_key or api_key_env, not both")
    elif "api_key" in table:
        raw = table["api_key"]
        if isinstance(raw, str):
            return raw.strip()
        # Only the type is named: the value is (meant to be) a secret.
        reader.add(
            f"{path}.api_key",
            f"expected a string, got {describe(raw, secret=True)}",
        )
    elif "api_key_env" in table:
        return _read_api_key_env(
            reader, table["api_key_env"], path, invalid, enabled=enabled
        )
    else:
        return None
    invalid.add("api_key")
    return None


def _read_api_key_env(
    reader: ValueReader,
    variable: object,
    path: str,
    invalid: set[str],
    *,
    enabled: bool,
) -> str | None:
    key_path = f"{path}.api_key_env"
    if not isinstance(variable, str) or not variable.strip():
        reader.add(
            key_path,
            f"expected the name of an environment variable, got {describe(variable)}",
        )
        invalid.add("api_key")
        return None
    name = variable.strip()
    value = reader.environ.get(name, "").strip()
    if value:
        return value
    state = "is not set" if name not in reader.environ else "is empty"
    if enabled:
        reader.add(
            key_path,
            f"environment variable {name} {state} (set it, or give the backend "
            "enabled = false to import it without a key)",
        )
        invalid.add("api_key")
    else:
        reader.warn(
            key_path,
            f"environment variable {name} {state}: the backend is disabled, so it "
            "is imported without a key (keeping any key it has); set the variable "
            "and import again before enabling it",
        )
    return None


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
