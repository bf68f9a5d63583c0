"""The structural difference between two exported configurations.

Each configuration is the export parsed as TOML. The comparison knows no
section by name: tables are compared key by key, and an array of tables whose
entries each have a distinct ``name`` (``[[backends]]``, ``[[backends.models]]``,
``[[keys]]``) is compared entry by entry by that name, so a section added to
the export later is covered without code here. Any other value (a fallback
chain's list, a price's inline table) is compared whole.

A change is ``{"path": [...], "change": "added" | "removed" | "changed",
"before": ..., "after": ...}`` (``before`` only for removed and changed,
``after`` only for added and changed). A secret's change carries neither:
``{"path": ["backends", "gpu-1", "api_key"], "change": "changed", "secret":
true}``.
"""

from __future__ import annotations

import datetime
import json
import tomllib
from collections.abc import Iterator, Mapping
from typing import Any, NotRequired, TypedDict

from routing.config_file.literals import format_key

ADDED = "added"
REMOVED = "removed"
CHANGED = "changed"
_NAME = "name"
# Only the first version has no difference: nothing came before it.
FIRST_VERSION = "the configuration when the history started"


class Change(TypedDict):
    """One difference between two configurations (JSON as stored and served)."""

    path: list[str]
    change: str
    before: NotRequired[Any]
    after: NotRequired[Any]
    secret: NotRequired[bool]


def read_document(text: str) -> dict[str, Any]:
    """Parse an export into plain JSON values (dates become ISO 8601 text)."""
    return _plain(tomllib.loads(text))


def diff_documents(
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    *,
    secrets_before: Mapping[str, str] | None = None,
    secrets_after: Mapping[str, str] | None = None,
) -> list[Change]:
    """Return every difference from ``before`` to ``after``, in a stable order.

    ``secrets_*`` map a backend's name to a fingerprint of its API key; a
    different fingerprint is reported as the key having changed, never with
    either value.
    """
    changes = list(_diff_tables([], before, after))
    changes += _diff_secrets(secrets_before or {}, secrets_after or {})
    return changes


def format_path(path: list[str]) -> str:
    """The path the way a TOML file spells it: ``backends."gpu-1".priority``."""
    return ".".join(format_key(part) for part in path)


def format_value(value: Any) -> str:
    """A value in short JSON (strings quoted), as the admin shows it."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def describe_change(change: Change) -> str:
    """One line a person reads: ``routing.max_retries: 2 → 3``."""
    where = format_path(change["path"])
    if change.get("secret"):
        return f"{where}: {change['change']} (secret, value not kept)"
    if change["change"] == ADDED:
        return f"{where}: added {format_value(change['after'])}"
    if change["change"] == REMOVED:
        return f"{where}: removed (was {format_value(change['before'])})"
    before, after = format_value(change["before"]), format_value(change["after"])
    return f"{where}: {before} → {after}"


def summarize_version(changes: list[Change], reverted_to: int | None) -> str:
    """A version's changes on one line, as the history's lists show them."""
    if reverted_to is not None:
        return f"revert to version {reverted_to}: {summarize(changes)}"
    return summarize(changes) if changes else FIRST_VERSION


def summarize(changes: list[Change], limit: int = 3) -> str:
    """The first few changes on one line, and how many more there are."""
    if not changes:
        return "no change"
    shown = "; ".join(describe_change(change) for change in changes[:limit])
    more = len(changes) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


def _diff_tables(
    path: list[str], before: Mapping[str, Any], after: Mapping[str, Any]
) -> Iterator[Change]:
    for key in _ordered_keys(before, after):
        where = [*path, key]
        # An array of named tables the export leaves out when it is empty
        # ([[backends]], [[keys]]) is compared entry by entry all the same.
        if key not in after:
            if _by_name(before[key]) is not None:
                yield from _diff_values(where, before[key], [])
            else:
                yield {"path": where, "change": REMOVED, "before": before[key]}
        elif key not in before:
            if _by_name(after[key]) is not None:
                yield from _diff_values(where, [], after[key])
            else:
                yield {"path": where, "change": ADDED, "after": after[key]}
        else:
            yield from _diff_values(where, before[key], after[key])


def _diff_values(path: list[str], before: Any, after: Any) -> Iterator[Change]:
    if isinstance(before, dict) and isinstance(after, dict):
        yield from _diff_tables(path, before, after)
        return
    named_before, named_after = _by_name(before), _by_name(after)
    if named_before is not None and named_after is not None:
        yield from _diff_tables(path, named_before, named_after)
        return
    if before != after:
        yield {"path": path, "change": CHANGED, "before": before, "after": after}


def _by_name(value: Any) -> dict[str, Any] | None:
    """An array of tables with distinct names, as a table keyed by name."""
    if not isinstance(value, list):
        return None
    entries: dict[str, Any] = {}
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get(_NAME), str):
            return None
        if entry[_NAME] in entries:
            return None
        entries[entry[_NAME]] = {k: v for k, v in entry.items() if k != _NAME}
    return entries


def _ordered_keys(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    # The order of the file (after's, then what only before had).
    return [*after, *(key for key in before if key not in after)]


def _diff_secrets(
    before: Mapping[str, str], after: Mapping[str, str]
) -> Iterator[Change]:
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        change = ADDED if old is None else REMOVED if new is None else CHANGED
        yield {"path": ["backends", name, "api_key"], "change": change, "secret": True}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    return value
