"""Management commands that use the database find it migrated.

``nexus_run`` migrates when it starts; the other ``nexus_*`` commands may be
run first, on a fresh state directory (``nexus_import_config`` before the
first ``make run``), where they used to die with "no such table". In the
embedded default the database is this checkout's private SQLite file, so it
is migrated there and then; in production it is shared with running
gateways, so the command stops and says how to migrate instead of changing a
schema under them.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor

from nexus_lib.authorship import VIA_COMMAND, ChangeAuthor, acting_as


def unapplied_migrations() -> int:
    """How many migrations the default database still lacks."""
    executor = MigrationExecutor(connections[DEFAULT_DB_ALIAS])
    return len(executor.migration_plan(executor.loader.graph.leaf_nodes()))


class DatabaseCommand(BaseCommand):
    """A command that reads or writes the database (see the module's doc)."""

    def execute(self, *args: Any, **options: Any) -> Any:
        missing = unapplied_migrations()
        if missing:
            if settings.NEXUS_PRODUCTION:
                raise CommandError(
                    f"The database lacks {missing} migration(s) of this version "
                    "of Nexus. Run `python manage.py migrate` (nexus_run also "
                    "migrates when it starts), then this command again."
                )
            self.stderr.write(
                f"Preparing the database ({missing} migration(s)); "
                "nexus_run would have done it on its first start."
            )
            call_command("migrate", interactive=False, verbosity=0)
        # The configuration history names the command behind its changes.
        name = type(self).__module__.rsplit(".", 1)[-1]
        with acting_as(ChangeAuthor(f"command {name}", VIA_COMMAND)):
            return super().execute(*args, **options)
