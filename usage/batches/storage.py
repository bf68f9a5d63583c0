"""Where batch files' bytes live: one directory (NEXUS_BATCH_DIR).

In the embedded default it is in the state directory; in production it must
be a directory every serving process and Celery worker reaches (one host, or
a shared volume). Not an object store (django-storages): the runner appends
each finished line to the batch's result files and, after a crash, truncates
a half-written last line and reads what is there to resume; object stores
cannot append.

Paths are relative to the directory and made only from ids Nexus generated.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from django.conf import settings

CHUNK = 1024 * 1024


def root() -> Path:
    """The batch directory (created on first use)."""
    directory = Path(settings.NEXUS_BATCH_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def input_path(file_id: str) -> str:
    return f"files/{file_id}.jsonl"


def result_paths(batch_id: str) -> tuple[str, str]:
    """The batch's output and error files (appended to while it runs)."""
    return f"batches/{batch_id}/output.jsonl", f"batches/{batch_id}/errors.jsonl"


def absolute(path: str) -> Path:
    return root() / path


def save_upload(path: str, chunks: Iterator[bytes]) -> int:
    """Write `chunks` to `path` (atomically: a temporary name, then renamed)."""
    target = absolute(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    size = 0
    with partial.open("wb") as out:
        for chunk in chunks:
            out.write(chunk)
            size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    partial.replace(target)
    return size


def open_for_reading(path: str) -> BinaryIO:
    return absolute(path).open("rb")


def read_chunks(path: str) -> Iterator[bytes]:
    """The file's bytes, a megabyte at a time ("" when it does not exist)."""
    try:
        handle = open_for_reading(path)
    except FileNotFoundError:
        return
    with handle:
        while chunk := handle.read(CHUNK):
            yield chunk


def size_of(path: str) -> int:
    try:
        return absolute(path).stat().st_size
    except FileNotFoundError:
        return 0


def delete(path: str) -> None:
    """Delete a file (gone already is fine)."""
    absolute(path).unlink(missing_ok=True)


def delete_batch_dir(batch_id: str) -> None:
    shutil.rmtree(root() / "batches" / batch_id, ignore_errors=True)
