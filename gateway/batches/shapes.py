"""The objects the SDKs read: OpenAI's File and Batch, Anthropic's MessageBatch."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from usage.models import Batch, BatchStatus, File

_ANTHROPIC_STATUS: dict[str, str] = {
    BatchStatus.CANCELLING: "canceling",
    BatchStatus.VALIDATING: "in_progress",
    BatchStatus.IN_PROGRESS: "in_progress",
    BatchStatus.FINALIZING: "in_progress",
}


def openai_file(file: File) -> dict[str, Any]:
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": _unix(file.created_at),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": _unix(file.expires_at),
    }


def openai_batch(batch: Batch) -> dict[str, Any]:
    failed = batch.failed + batch.cancelled_lines + batch.expired_lines
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": _errors(batch.errors),
        "input_file_id": batch.input_file_key,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": _unix(batch.created_at),
        "in_progress_at": _unix(batch.in_progress_at),
        "expires_at": _unix(batch.expires_at),
        "finalizing_at": _unix(batch.finalizing_at),
        "completed_at": _unix(batch.completed_at),
        "failed_at": _unix(batch.failed_at),
        "expired_at": _unix(batch.expired_at),
        "cancelling_at": _unix(batch.cancelling_at),
        "cancelled_at": _unix(batch.cancelled_at),
        "request_counts": {
            "total": batch.total,
            "completed": batch.completed,
            "failed": failed,
        },
        "metadata": batch.metadata,
        "usage": {
            "input_tokens": batch.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": batch.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": batch.prompt_tokens + batch.completion_tokens,
        },
    }


def anthropic_batch(batch: Batch, results_url: str) -> dict[str, Any]:
    ended = not batch.is_active
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": _ANTHROPIC_STATUS.get(batch.status, "ended"),
        "request_counts": {
            "processing": 0 if ended else max(0, batch.total - batch.done),
            "succeeded": batch.completed,
            "errored": batch.failed,
            "canceled": batch.cancelled_lines,
            "expired": batch.expired_lines,
        },
        "ended_at": _rfc3339(batch.ended_at()),
        "created_at": _rfc3339(batch.created_at),
        "expires_at": _rfc3339(batch.expires_at),
        "archived_at": None,
        "cancel_initiated_at": _rfc3339(batch.cancelling_at),
        "results_url": results_url if ended else None,
    }


def _errors(errors: Any) -> dict[str, Any] | None:
    if not errors:
        return None
    return {"object": "list", "data": errors}


def _unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def _rfc3339(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat().replace("+00:00", "Z")
