"""A batch's life outside the runner: upload, create, cancel, delete, resume.

The HTTP surfaces (``gateway.batches``) call these with the caller's key
prefix; each raises ``BatchRequestError`` with the status, message and param
the caller is told. Starting a batch hands its id to the ``batches`` Celery
queue once the transaction commits; ``resume_batches`` (Celery beat) starts
again any active batch no live runner holds (its worker died), and deletes
files past their expiry.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from kombu.exceptions import KombuError

from usage.batches import storage
from usage.batches.validation import (
    ANTHROPIC_ENDPOINT,
    OPENAI_ENDPOINTS,
    check_anthropic_requests,
    check_openai_input,
    split_lines,
)
from usage.models import Batch, BatchApi, BatchStatus, File, FilePurpose, new_object_id

logger = logging.getLogger(__name__)

RUN_TASK = "usage.tasks.run_batch"
_WINDOW = re.compile(r"([1-9][0-9]{0,2})h")
MAX_WINDOW_HOURS = 720
MAX_METADATA_KEYS = 16


class BatchRequestError(Exception):
    """A request about batches or files that cannot be done, as the caller is told."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def not_found(kind: str, object_id: str) -> BatchRequestError:
    return BatchRequestError(
        404, f"No such {kind}: '{object_id:.64}'", code="not_found"
    )


# Files ----------------------------------------------------------------------


def store_input_file(owner: str, filename: str, chunks: Iterable[bytes]) -> File:
    """Keep an uploaded batch input file once its every line checks out."""
    file_id = new_object_id("file-")
    path = storage.input_path(file_id)
    limit = settings.NEXUS_BATCH_MAX_FILE_BYTES
    try:
        size = storage.save_upload(path, _at_most(chunks, limit))
    except _TooLarge:
        storage.delete(path)
        raise BatchRequestError(
            413,
            f"The file is larger than this gateway accepts ({limit} bytes).",
            param="file",
            code="file_too_large",
        ) from None
    checked = check_openai_input(
        split_lines(storage.read_chunks(path)), settings.NEXUS_BATCH_MAX_LINES
    )
    if checked.problems:
        storage.delete(path)
        raise BatchRequestError(
            400,
            f"Invalid batch input file: {checked.summary()}.",
            param="file",
            code="invalid_batch_file",
        )
    return File.objects.create(
        id=file_id,
        owner_prefix=owner,
        purpose=FilePurpose.BATCH,
        filename=(filename or "batch.jsonl")[:255],
        bytes=size,
        line_count=checked.lines,
        endpoint=checked.endpoint,
        path=path,
        expires_at=timezone.now() + timedelta(days=settings.NEXUS_BATCH_FILE_DAYS),
    )


class _TooLarge(Exception):
    pass


def _at_most(chunks: Iterable[bytes], limit: int) -> Iterator[bytes]:
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        yield chunk


def delete_file(file: File) -> None:
    """Delete a file and its bytes (not the input of a batch still running)."""
    if Batch.objects.active().filter(input_file=file).exists():
        raise BatchRequestError(
            409,
            f"The file {file.id} is the input of a batch that is still running; "
            "cancel the batch first.",
            param="file_id",
            code="file_in_use",
        )
    storage.delete(file.path)
    file.delete()


# Batches ---------------------------------------------------------------------


def create_batch(
    owner: str,
    input_file_id: Any,
    endpoint: Any,
    completion_window: Any,
    metadata: Any = None,
) -> Batch:
    """Create an OpenAI batch of a checked input file (raises BatchRequestError)."""
    if endpoint not in OPENAI_ENDPOINTS:
        raise BatchRequestError(
            400,
            f"endpoint must be one of {', '.join(OPENAI_ENDPOINTS)}.",
            param="endpoint",
            code="invalid_value",
        )
    hours = _window_hours(completion_window)
    _check_metadata(metadata)
    if not isinstance(input_file_id, str):
        raise BatchRequestError(
            400, "input_file_id is required.", param="input_file_id"
        )
    file = File.objects.filter(id=input_file_id, owner_prefix=owner).first()
    if file is None:
        raise not_found("File", input_file_id)
    if file.purpose != FilePurpose.BATCH:
        raise BatchRequestError(
            400,
            f"The file {file.id} was not uploaded with purpose 'batch'.",
            param="input_file_id",
            code="invalid_file",
        )
    if file.endpoint != endpoint:
        raise BatchRequestError(
            400,
            f"The batch is for {endpoint} but the requests of {file.id} are for "
            f"{file.endpoint} (line 1).",
            param="endpoint",
            code="mismatched_endpoint",
        )
    now = timezone.now()
    batch = Batch.objects.create(
        id=new_object_id("batch_"),
        api=BatchApi.OPENAI,
        owner_prefix=owner,
        endpoint=endpoint,
        completion_window=completion_window,
        input_file=file,
        input_file_key=file.id,
        total=file.line_count,
        metadata=metadata,
        created_at=now,
        expires_at=now + timedelta(hours=hours),
    )
    start(batch.id)
    return batch


def create_message_batch(owner: str, requests: Any) -> Batch:
    """Create an Anthropic Message Batch (raises BatchRequestError)."""
    checked = check_anthropic_requests(requests, settings.NEXUS_BATCH_MAX_LINES)
    if checked.problems:
        parts = [f"requests.{p.line}.{p.message}" for p in checked.problems[:5]]
        raise BatchRequestError(400, "; ".join(parts), param="requests")
    file_id = new_object_id("file-")
    path = storage.input_path(file_id)
    size = storage.save_upload(path, _anthropic_lines(requests))
    now = timezone.now()
    with transaction.atomic():
        file = File.objects.create(
            id=file_id,
            owner_prefix=owner,
            purpose=FilePurpose.BATCH,
            filename="message_batch_requests.jsonl",
            bytes=size,
            line_count=checked.lines,
            endpoint=ANTHROPIC_ENDPOINT,
            path=path,
            expires_at=now + timedelta(days=settings.NEXUS_BATCH_FILE_DAYS),
        )
        batch = Batch.objects.create(
            id=new_object_id("msgbatch_"),
            api=BatchApi.ANTHROPIC,
            owner_prefix=owner,
            endpoint=ANTHROPIC_ENDPOINT,
            input_file=file,
            input_file_key=file.id,
            total=checked.lines,
            created_at=now,
            expires_at=now + timedelta(hours=24),
        )
        start(batch.id)
    return batch


def _anthropic_lines(requests: list[dict[str, Any]]) -> Iterator[bytes]:
    for request in requests:
        line = {
            "custom_id": request["custom_id"],
            "method": "POST",
            "url": ANTHROPIC_ENDPOINT,
            "body": request["params"],
        }
        yield json.dumps(line, separators=(",", ":")).encode() + b"\n"


def cancel_batch(batch: Batch) -> Batch:
    """Ask the runner to stop: no new line starts; what finished stays."""
    if not batch.is_active:
        raise BatchRequestError(
            409,
            f"Cannot cancel a batch that is {batch.status}.",
            code="batch_not_cancellable",
        )
    if batch.status != BatchStatus.CANCELLING:
        Batch.objects.filter(pk=batch.pk, status__in=_CANCELLABLE).update(
            status=BatchStatus.CANCELLING, cancelling_at=timezone.now()
        )
        batch.refresh_from_db()
        start(batch.id)  # a batch no runner holds is finished at once
    return batch


_CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


def delete_batch(batch: Batch) -> None:
    """Delete an ended batch and its files."""
    if batch.is_active:
        raise BatchRequestError(
            409,
            f"Cannot delete a batch that is {batch.status}; cancel it first.",
            code="batch_not_ended",
        )
    for file in (batch.output_file, batch.error_file):
        if file is not None:
            file.delete()
    storage.delete_batch_dir(batch.id)
    batch.delete()


def start(batch_id: str) -> None:
    """Hand the batch to a runner once the transaction commits."""
    transaction.on_commit(lambda: _send(batch_id))


def _send(batch_id: str) -> None:
    try:
        current_app.send_task(RUN_TASK, args=[batch_id])
    except (OSError, KombuError):  # the beat's resume_batches starts it later
        logger.warning("Could not queue batch %s; it is resumed later", batch_id)


def resume_batches() -> int:
    """Queue every active batch no live runner holds; delete expired files.

    Returns how many batches were queued.
    """
    now = timezone.now()
    queued = 0
    for batch_id in Batch.objects.claimable(now).values_list("id", flat=True)[:1000]:
        _send(batch_id)
        queued += 1
    for file in File.objects.filter(expires_at__lt=now)[:1000]:
        try:
            delete_file(file)
        except BatchRequestError:
            continue  # still the input of a running batch
    return queued


def _window_hours(window: Any) -> int:
    match = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    if match is None or int(match[1]) > MAX_WINDOW_HOURS:
        raise BatchRequestError(
            400,
            f"completion_window must be a number of hours like '24h' (at most "
            f"{MAX_WINDOW_HOURS}h), got {window!r:.40}.",
            param="completion_window",
            code="invalid_value",
        )
    return int(match[1])


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    valid = (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA_KEYS
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items()
        )
    )
    if not valid:
        raise BatchRequestError(
            400,
            f"metadata must be at most {MAX_METADATA_KEYS} string pairs (keys up "
            "to 64 characters, values up to 512).",
            param="metadata",
            code="invalid_value",
        )
