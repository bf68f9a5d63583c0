"""Batch jobs: uploaded files and the batches that run their lines.

A ``File`` is a JSONL file a key uploaded (``purpose="batch"``: one request
per line) or a batch's output or error file (``"batch_output"``); its bytes
live in the batch storage directory (``usage.batches.storage``), the row
holds what the Files API shows. A ``Batch`` runs every line of its input file
through the gateway as its owner key, at the batch band (the OpenAI Batches
and Anthropic Message Batches APIs: ``api`` says which one created it). The
runner holding its lease (``lease_owner`` until ``lease_until``) appends each
finished line to the output or error file, so a restarted worker resumes
where the last one stopped (``usage.batches.runner``).
"""

from __future__ import annotations

import secrets
from datetime import datetime

from django.db import models
from django.db.models import Q
from django.utils import timezone

from usage.models.keys import PREFIX_LENGTH


def new_object_id(prefix: str) -> str:
    """An id like OpenAI's and Anthropic's (``file-...``, ``batch_...``)."""
    return f"{prefix}{secrets.token_hex(12)}"


class FilePurpose(models.TextChoices):
    BATCH = "batch", "Batch input"
    BATCH_OUTPUT = "batch_output", "Batch output"


class File(models.Model):
    """A file of the Files API: a batch's input, output or errors (JSONL)."""

    id = models.CharField(primary_key=True, max_length=40, editable=False)
    owner_prefix = models.CharField(
        "owner key", max_length=PREFIX_LENGTH, blank=True, default="", db_index=True
    )
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField(default=0)
    line_count = models.PositiveIntegerField("lines", default=0)
    # The endpoint every line of a batch input names ("/v1/chat/completions").
    endpoint = models.CharField(max_length=40, blank=True, default="")
    path = models.CharField(
        max_length=200, help_text="Where its bytes are, in the batch storage."
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")
        verbose_name = "batch file"

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class BatchStatus(models.TextChoices):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ACTIVE_STATUSES = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
)


class BatchApi(models.TextChoices):
    OPENAI = "openai", "OpenAI Batches"
    ANTHROPIC = "anthropic", "Anthropic Message Batches"


class BatchQuerySet(models.QuerySet["Batch"]):
    def active(self) -> BatchQuerySet:
        """Batches not ended yet (a runner has work left on them)."""
        return self.filter(status__in=ACTIVE_STATUSES)

    def claimable(self, now: datetime) -> BatchQuerySet:
        """Active batches no live runner holds (never leased, or its lease ran out)."""
        return self.active().filter(
            Q(lease_until__isnull=True) | Q(lease_until__lt=now)
        )


class Batch(models.Model):
    """A batch job: every line of its input file, run as its owner key."""

    id = models.CharField(primary_key=True, max_length=40, editable=False)
    api = models.CharField(
        max_length=16, choices=BatchApi.choices, default=BatchApi.OPENAI
    )
    owner_prefix = models.CharField(
        "owner key", max_length=PREFIX_LENGTH, blank=True, default="", db_index=True
    )
    endpoint = models.CharField(max_length=40)
    completion_window = models.CharField(max_length=8, default="24h")
    input_file = models.ForeignKey(
        File, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    input_file_key = models.CharField(
        "input file id", max_length=40, help_text="Kept when the file is deleted."
    )
    output_file = models.ForeignKey(
        File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    error_file = models.ForeignKey(
        File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    status = models.CharField(
        max_length=16,
        choices=BatchStatus.choices,
        default=BatchStatus.VALIDATING,
        db_index=True,
    )
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField("succeeded", default=0)
    failed = models.PositiveIntegerField("errored", default=0)
    cancelled_lines = models.PositiveIntegerField("canceled", default=0)
    expired_lines = models.PositiveIntegerField("expired", default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(
        null=True, blank=True, help_text="Why validation failed, with line numbers."
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=100, blank=True, default="")
    lease_until = models.DateTimeField(null=True, blank=True)

    objects = BatchQuerySet.as_manager()

    class Meta:
        ordering = ("-created_at", "-id")
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    @property
    def done(self) -> int:
        """Lines with a result (output or error) so far."""
        return self.completed + self.failed + self.cancelled_lines + self.expired_lines

    def ended_at(self) -> datetime | None:
        """When it reached its final status (None while active)."""
        return (
            self.completed_at or self.failed_at or self.expired_at or self.cancelled_at
        )
