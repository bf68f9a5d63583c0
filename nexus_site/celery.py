"""The Celery application: configured from Django's CELERY_* settings."""

from __future__ import annotations

import logging
import os
import stat
import warnings
from contextvars import Token
from pathlib import Path
from typing import Any

from celery import Celery, signals
from celery.exceptions import SecurityWarning

from nexus_lib.authorship import VIA_TASK, ChangeAuthor, start_acting_as, stop_acting_as

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nexus_site.settings")

app = Celery("nexus")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# Per-task lines ("Task ... received/succeeded", beat's "Sending due task"),
# every few seconds for health, usage and rollups: DEBUG detail, not what a
# person running Nexus needs to see. What the tasks log themselves (a backend
# changing state, discovery finding models) stays at INFO.
TASK_CHATTER_LOGGERS = ("celery.app.trace", "celery.worker.strategy")


class _NoDueTaskLines(logging.Filter):
    """Drop beat's "Scheduler: Sending due task ..." (keep its start-up line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Scheduler: Sending due task")


_NO_DUE_TASK_LINES = _NoDueTaskLines()


@signals.after_setup_logger.connect
def quiet_task_chatter(**kwargs: Any) -> None:
    """Show Celery's per-task lines only when the log level is DEBUG."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in TASK_CHATTER_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger("celery.beat").addFilter(_NO_DUE_TASK_LINES)


@signals.celeryd_init.connect
def accept_root_with_a_private_state_dir(**kwargs: Any) -> None:
    """Drop Celery's "superuser privileges" warning when it adds nothing.

    Containers and single-user machines run Nexus as root. The worker only
    reads and writes the state directory (and the database); when that
    directory is private to the user running it, the warning only alarms.
    """
    from django.conf import settings

    if os.geteuid() == 0 and is_private_dir(Path(settings.NEXUS_STATE_DIR)):
        warnings.filterwarnings(
            "ignore", message=".*superuser privileges", category=SecurityWarning
        )


def is_private_dir(path: Path) -> bool:
    """Owned by this user, with no access for group or others."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.geteuid() and not stat.S_IMODE(info.st_mode) & 0o077


# The configuration history names the task behind a change (model discovery).
_acting: dict[str, Token[ChangeAuthor | None]] = {}


@signals.task_prerun.connect
def attribute_changes_to_task(task_id: str, task: Any, **kwargs: Any) -> None:
    """Changes a task makes are the task's in the configuration history."""
    name = str(task.name).rsplit(".", 1)[-1]
    _acting[task_id] = start_acting_as(ChangeAuthor(f"task {name}", VIA_TASK))


@signals.task_postrun.connect
def end_task_attribution(task_id: str, **kwargs: Any) -> None:
    token = _acting.pop(task_id, None)
    if token is not None:
        stop_acting_as(token)
