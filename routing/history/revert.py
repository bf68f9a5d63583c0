"""Revert the configuration to a version of the history, through the import.

The version's export is read and imported with ``replace`` (what it does not
mention is deleted), so it passes every check a TOML import does and applies
all at once or not at all; the result is recorded as a new version. Client
keys are credentials, not configuration: a key the version does not list gets
its limits reset (as the version had it), a key that no longer exists is left
out with a warning, and no key is created or deleted. API keys of backends are
never kept in the history, so a backend keeps the key it has now; the result
warns where that differs from the version.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nexus_lib.authorship import VIA_REVERT
from routing.config_file import ConfigFile, import_config, read_config
from routing.config_file.literals import format_string
from routing.config_file.schema import KeyEntry
from routing.config_file.usage_tables import default_key_values
from routing.history.diff import Change, diff_documents, read_document, summarize
from routing.history.recording import Captured, capture_config, recording_changes
from routing.models import ConfigRevision
from usage.models import ApiKey

MAX_VERSION_NUMBER = 2**31 - 1  # PositiveIntegerField's range everywhere


class VersionNotFound(LookupError):
    """No version of the history has this number (never, or pruned)."""

    def __init__(self, number: int) -> None:
        self.number = number
        super().__init__(
            f"The configuration history has no version {number} (it may have "
            "been deleted: only the newest NEXUS_CONFIG_HISTORY_KEEP are kept)."
        )


def find_version(number: int) -> ConfigRevision:
    """The version numbered ``number``; raise VersionNotFound."""
    # A number past the column's range would be a database error, not a miss.
    if not 0 < number <= MAX_VERSION_NUMBER:
        raise VersionNotFound(number)
    target = ConfigRevision.objects.filter(number=number).first()
    if target is None:
        raise VersionNotFound(number)
    return target


@dataclass(frozen=True)
class RevertResult:
    """What a revert changed, or (dry run) would change."""

    target: int
    # The version the revert recorded; None for a dry run or nothing to change.
    version: int | None
    changes: list[Change]
    warnings: list[str]
    dry_run: bool


def revert_to(number: int, *, dry_run: bool = False) -> RevertResult:
    """Make the configuration what it was at version ``number``.

    Raise VersionNotFound, or ConfigError (nothing changed) when the version
    cannot be applied to the database as it is now.
    """
    target = find_version(number)
    source = f"version {number}"
    with recording_changes(via=VIA_REVERT) as scope:
        # The state compared with is the one the import changes.
        scope.lock()
        current = capture_config()
        changes = diff_documents(
            read_document(current.text),
            read_document(target.snapshot),
            secrets_before=current.secret_marks,
            secrets_after=target.secret_marks,
        )
        config, warnings = _config_of(target, source, current)
        changed_before = scope.changed
        import_config(config, source=source, replace=True, dry_run=dry_run)
        if dry_run:
            scope.changed = changed_before  # rolled back: nothing to record
            return RevertResult(number, None, changes, warnings, dry_run=True)
        scope.reverted_to = number
        revision = scope.record()
        result = (
            Captured(revision.snapshot, revision.secret_marks)
            if revision is not None
            else current
        )
    warnings += _differences_left(target, result)
    version = revision.number if revision is not None else None
    return RevertResult(number, version, changes, warnings, dry_run=False)


def _config_of(
    target: ConfigRevision, source: str, current: Captured
) -> tuple[ConfigFile, list[str]]:
    """The version's file, with client keys matched to the keys there are now."""
    config = read_config(target.snapshot, source, environ={})
    warnings: list[str] = []
    kept: list[KeyEntry] = []
    existing = set(
        ApiKey.objects.filter(name__in=[e.name for e in config.keys]).values_list(
            "name", flat=True
        )
    )
    for entry in config.keys:
        if entry.name in existing:
            kept.append(entry)
        else:
            warnings.append(
                f"client key {format_string(entry.name)} no longer exists: its "
                f"limits at {source} are not restored"
            )
    listed = {entry.name for entry in config.keys}
    now = read_document(current.text).get("keys", [])
    resets = [
        KeyEntry(
            f"keys ({format_string(name)}, without limits at {source})",
            name,
            default_key_values(),
        )
        for name in sorted({entry["name"] for entry in now} - listed)
    ]
    return dataclasses.replace(config, keys=(*kept, *resets)), warnings


def _differences_left(target: ConfigRevision, result: Captured) -> list[str]:
    """What the revert could not restore: keys, credentials outside the file."""
    warnings = []
    for name, mark in sorted(target.secret_marks.items()):
        now = result.secret_marks.get(name)
        if now is None:
            warnings.append(
                f"backend {format_string(name)} had an API key at version "
                f"{target.number} and has none now: API keys are never kept in "
                "the history, set it again"
            )
        elif now != mark:
            warnings.append(
                f"backend {format_string(name)} keeps its current API key (a "
                f"different one from version {target.number}'s, which the "
                "history never keeps)"
            )
    if result.text != target.snapshot:
        left = diff_documents(
            read_document(target.snapshot), read_document(result.text)
        )
        warnings.append(
            f"the configuration still differs from version {target.number}: "
            + summarize(left)
        )
    return warnings
