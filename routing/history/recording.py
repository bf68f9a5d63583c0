"""Record each committed configuration change as a version of the history.

A version is the canonical export after the change, its difference from the
version before, and who made it. Two ways lead there:

* **A recorded change** (``recording_changes()``): the admin and the API (one
  block per request, nexus_site/change_recording.py), a TOML import and a revert
  run in one transaction; the first routing change inside it takes the
  history lock (a PostgreSQL advisory lock held to the end of the
  transaction; SQLite's writers are serialized by ``BEGIN IMMEDIATE``), and
  the version is written in that same transaction, just before it commits.
  Two such changes from two processes therefore come out as two versions, in
  the order they committed, each with only its own difference.
* **Any other change** (a management command of a lower app, a Celery task,
  the shell) is recorded right after it commits, under the same lock,
  attributed to ``current_author()`` as it was at the change. One that commits while a recorded change
  is in flight shows up in that change's version instead.

A change that leaves the export as it was (a health status, a re-import of
the same file) records nothing. Only the newest ``NEXUS_CONFIG_HISTORY_KEEP``
versions are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, transaction
from django.utils.crypto import salted_hmac

from backends.models import Backend, BackendKind
from nexus_lib.authorship import VIA_SYSTEM, ChangeAuthor, current_author
from routing.config_file.exporter import export_config
from routing.history.diff import diff_documents, read_document
from routing.models import ConfigRevision

logger = logging.getLogger(__name__)

# pg_advisory_xact_lock's key: "NxHi" in ASCII.
LOCK_KEY = 0x4E78_4869
_FINGERPRINT_SALT = "nexus.routing.history.api_key"
# The author of the version recorded when the history starts (after migrate).
FIRST_AUTHOR = ChangeAuthor("nexus", VIA_SYSTEM)


@dataclass(frozen=True)
class Captured:
    """The configuration as the history keeps it: export text, key fingerprints."""

    text: str
    secret_marks: dict[str, str]


@dataclass
class ChangeScope:
    """One recorded change in progress (see ``recording_changes()``)."""

    author: Callable[[], ChangeAuthor]
    using: str
    via: str | None = None
    reverted_to: int | None = None
    changed: bool = False
    locked: bool = field(default=False, repr=False)

    def note_change(self) -> None:
        """A routing row changed in this transaction: hold the history lock."""
        self.lock()
        self.changed = True

    def lock(self) -> None:
        """Hold the history lock from now to the end of the transaction."""
        if not self.locked:
            lock_history(self.using)
            self.locked = True

    def record(self) -> ConfigRevision | None:
        """Record what changed so far now (inside the transaction)."""
        if not self.changed:
            return None
        self.changed = False
        author = self.author()
        if self.via is not None:
            author = ChangeAuthor(author.name, self.via)
        return record_version(author, reverted_to=self.reverted_to, using=self.using)


_scope: ContextVar[ChangeScope | None] = ContextVar("nexus_change_scope", default=None)


@contextmanager
def recording_changes(
    author: Callable[[], ChangeAuthor] = current_author,
    *,
    via: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> Iterator[ChangeScope]:
    """Run the block in one transaction that records its changes as one version.

    ``author`` is asked only when there is something to record (a request's
    user is known once its view has authenticated it). Inside another such
    block this joins it, and ``via`` (``import``, ``revert``) describes it.
    """
    outer = _scope.get()
    if outer is not None:
        if via is not None:
            outer.via = via
        yield outer
        return
    scope = ChangeScope(author, using, via=via)
    reset = _scope.set(scope)
    try:
        with transaction.atomic(using=using):
            yield scope
            if not transaction.get_rollback(using=using):
                scope.record()
    finally:
        _scope.reset(reset)


def note_config_change(using: str) -> None:
    """Called for each routing change: record it with its block, or after commit."""
    scope = _scope.get()
    connection = connections[using]
    if scope is not None and scope.using == using and connection.in_atomic_block:
        scope.note_change()
        return
    if connection.in_atomic_block and any(
        isinstance(entry[1], _RecordAfterCommit) for entry in connection.run_on_commit
    ):
        return
    transaction.on_commit(_RecordAfterCommit(current_author(), using), using=using)


@dataclass(frozen=True)
class _RecordAfterCommit:
    """Record the change once its transaction committed (author known now)."""

    author: ChangeAuthor
    using: str

    def __call__(self) -> None:
        try:
            # Most such changes (a health round's) leave the export alone:
            # found without a lock, they cost no write transaction.
            if _is_newest(capture_config(), self.using):
                return
            record_version(self.author, using=self.using)
        except Exception:
            # The next version's difference includes this change.
            logger.warning("Could not record a configuration version", exc_info=True)


def lock_history(using: str = DEFAULT_DB_ALIAS) -> None:
    """Hold the history lock until the current transaction ends."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [LOCK_KEY])
    # SQLite (transaction_mode IMMEDIATE): the transaction already holds the
    # database's only write lock.


def capture_config() -> Captured:
    """The configuration now, as a version keeps it."""
    keyed = (
        Backend.objects.filter(is_demo=False)
        .exclude(kind=BackendKind.RELAY)
        .exclude(api_key="")
        .values_list("name", "api_key")
    )
    marks = {name: fingerprint_secret(key) for name, key in keyed}
    return Captured(export_config(), marks)


def fingerprint_secret(secret: str) -> str:
    """A keyed fingerprint that changes when the secret does (never the secret)."""
    return salted_hmac(_FINGERPRINT_SALT, secret, algorithm="sha256").hexdigest()[:16]


def record_version(
    author: ChangeAuthor,
    *,
    reverted_to: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> ConfigRevision | None:
    """Record the configuration as a new version unless it is the newest one's.

    Return the new version, or None when nothing changed.
    """
    with transaction.atomic(using=using):
        lock_history(using)
        captured = capture_config()
        latest = ConfigRevision.objects.using(using).order_by("-number").first()
        if latest is not None and _is_same(latest, captured):
            return None
        diff = []
        if latest is not None:
            diff = diff_documents(
                read_document(latest.snapshot),
                read_document(captured.text),
                secrets_before=latest.secret_marks,
                secrets_after=captured.secret_marks,
            )
        revision = ConfigRevision.objects.using(using).create(
            number=latest.number + 1 if latest is not None else 1,
            author=author.name[:200],
            via=author.via,
            reverted_to=reverted_to,
            snapshot=captured.text,
            secret_marks=captured.secret_marks,
            diff=diff,
        )
        ConfigRevision.objects.using(using).filter(
            number__lte=revision.number - settings.NEXUS_CONFIG_HISTORY_KEEP
        ).delete()
    return revision


def _is_newest(captured: Captured, using: str) -> bool:
    latest = ConfigRevision.objects.using(using).order_by("-number").first()
    return latest is not None and _is_same(latest, captured)


def _is_same(revision: ConfigRevision, captured: Captured) -> bool:
    return (
        revision.snapshot == captured.text
        and revision.secret_marks == captured.secret_marks
    )


def record_first_version(using: str = DEFAULT_DB_ALIAS) -> None:
    """Record the configuration as the first version if the history is empty.

    Run after ``migrate``, so that the first change has a version to be
    compared with. Skipped while a table it reads is missing (a partial or
    backwards migration).
    """
    connection = connections[using]
    tables = set(connection.introspection.table_names())
    needed = {ConfigRevision._meta.db_table, Backend._meta.db_table}
    if not needed <= tables:
        return
    try:
        with transaction.atomic(using=using):
            lock_history(using)
            if not ConfigRevision.objects.using(using).exists():
                record_version(FIRST_AUTHOR, using=using)
    except DatabaseError:
        logger.info("The configuration history starts later", exc_info=True)
