"""The Celery app's console behaviour under nexus_run (issue 12, item 12)."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.exceptions import SecurityWarning

from nexus_site import celery as celery_app


@pytest.fixture
def _restore_loggers() -> Iterator[None]:
    levels = {
        name: logging.getLogger(name).level
        for name in (*celery_app.TASK_CHATTER_LOGGERS, "")
    }
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.usefixtures("_restore_loggers")
def test_per_task_lines_are_hidden_at_info_and_shown_at_debug() -> None:
    logging.getLogger().setLevel(logging.INFO)
    celery_app.quiet_task_chatter()
    trace = logging.getLogger("celery.app.trace")
    assert not trace.isEnabledFor(logging.INFO)
    beat = logging.getLogger("celery.beat")
    due = beat.makeRecord(
        "celery.beat", logging.INFO, "", 0, "Scheduler: Sending due task %s", (), None
    )
    starting = beat.makeRecord(
        "celery.beat", logging.INFO, "", 0, "beat: Starting...", (), None
    )
    assert (beat.filter(due), bool(beat.filter(starting))) == (False, True)
    beat.removeFilter(celery_app._NO_DUE_TASK_LINES)
    assert logging.getLogger("backends.health").isEnabledFor(logging.INFO)
    for name in celery_app.TASK_CHATTER_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    logging.getLogger().setLevel(logging.DEBUG)
    celery_app.quiet_task_chatter()
    assert trace.isEnabledFor(logging.DEBUG)


def test_a_private_state_dir_is_recognised(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    assert celery_app.is_private_dir(private)
    assert not celery_app.is_private_dir(shared)
    assert not celery_app.is_private_dir(tmp_path / "missing")


def test_the_root_warning_is_dropped_only_with_a_private_state_dir(
    tmp_path: Path, settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(celery_app, "is_private_dir", lambda path: path == tmp_path)
    for state_dir, shown in ((tmp_path / "other", 1), (tmp_path, 0)):
        settings.NEXUS_STATE_DIR = state_dir
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            celery_app.accept_root_with_a_private_state_dir()
            warnings.warn(
                SecurityWarning("You're running the worker with superuser privileges"),
                stacklevel=1,
            )
        assert len(caught) == shown
