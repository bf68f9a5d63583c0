"""Usage records: each gateway request's usage as the proxy recorded it.

``usage.flush`` writes a ``UsageRecord`` per request; the rollup adds the
pending ones to the aggregates (``usage.models.aggregates``) and to the keys'
spend, and the rolled-up ones are pruned after
NEXUS_USAGE_RECORD_RETENTION_HOURS. An ``OpenRequest`` is a request admitted
and not ended yet as far as the database knows: its settle removes it, or the
reconciliation (``usage.lost``) turns it into a record once its serving
process is gone. Open requests are never rolled up, so nothing counts twice.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import models
from django.db.models import Q
from django.utils import timezone

from usage.models.keys import PREFIX_LENGTH


class Endpoint(models.TextChoices):
    CHAT = "chat", "Chat completions"
    COMPLETIONS = "completions", "Completions"
    EMBEDDINGS = "embeddings", "Embeddings"
    MESSAGES = "messages", "Anthropic messages"
    RESPONSES = "responses", "OpenAI responses"
    OLLAMA_CHAT = "ollama-chat", "Ollama chat"
    OLLAMA_GENERATE = "ollama-generate", "Ollama generate"
    OLLAMA_EMBED = "ollama-embed", "Ollama embeddings"


class UsageRecordQuerySet(models.QuerySet["UsageRecord"]):
    def pending(self) -> UsageRecordQuerySet:
        """Records not yet added to the aggregates."""
        return self.filter(rolled_up=False)

    def prune(self, retention_hours: float) -> int:
        """Delete rolled-up records older than the retention; return how many."""
        cutoff = timezone.now() - timedelta(hours=retention_hours)
        deleted, _ = self.filter(rolled_up=True, created_at__lt=cutoff).delete()
        return deleted


class UsageRecord(models.Model):
    """One gateway request's usage, as the proxy recorded it, before rollup.

    Written only by ``usage.flush``; the rollup adds each row to TokenUsage and
    UsageBucket and sets ``rolled_up`` in the same transaction. Rolled-up rows
    are kept for a while (NEXUS_USAGE_RECORD_RETENTION_HOURS): a flush retried
    after an ambiguous failure then still finds its rows by ``event_id`` and
    does not write them twice.
    """

    event_id = models.CharField(
        max_length=32, unique=True, help_text="Nexus's unique id for the event."
    )
    request_id = models.CharField(
        max_length=128,
        db_index=True,
        help_text="The X-Request-Id of the request (may repeat).",
    )
    endpoint = models.CharField(max_length=16, choices=Endpoint.choices)
    api_key_prefix = models.CharField(
        "API key", max_length=PREFIX_LENGTH, blank=True, default=""
    )
    backend = models.CharField(max_length=100, blank=True, default="")
    requested_model = models.CharField(max_length=200, blank=True, default="")
    served_model = models.CharField(max_length=200, blank=True, default="")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    total_tokens = models.PositiveBigIntegerField(default=0)
    cache_read_tokens = models.PositiveBigIntegerField(
        "cached input tokens",
        default=0,
        help_text="Of the prompt tokens: read from the backend's prompt cache.",
    )
    cache_write_tokens = models.PositiveBigIntegerField(
        "cache write tokens",
        default=0,
        help_text="Of the prompt tokens: written to the backend's prompt cache.",
    )
    estimated = models.BooleanField(
        default=False, help_text="Token counts are Nexus's estimate."
    )
    latency_ms = models.FloatField("latency (ms)", default=0.0)
    cost_nanos = models.PositiveBigIntegerField("cost (nano-USD)", default=0)
    status = models.PositiveSmallIntegerField(help_text="HTTP status sent.")
    streamed = models.BooleanField(default=False)
    error = models.CharField(max_length=100, blank=True, default="")
    context_shifts = models.PositiveSmallIntegerField(
        default=0,
        help_text="Times context shift trimmed the request (a retry after an "
        "overflow, a pre-trim, a trim to the known context); the tokens are "
        "the successful attempt's.",
    )
    ensemble_id = models.CharField(
        "ensemble",
        max_length=32,
        blank=True,
        default="",
        db_index=True,
        help_text="Shared by the requests Nexus made for one multiple-opinions "
        "(moe-<model>) request: its answers, critiques and refined answer.",
    )
    cache_hit = models.BooleanField(
        "cache hit",
        default=False,
        help_text="Answered from the response cache: the tokens are the stored "
        "answer's (saved, not spent); the cost is the model's cache hit price.",
    )
    batch_id = models.CharField(
        "batch",
        max_length=40,
        blank=True,
        default="",
        db_index=True,
        help_text="A batch job's line: the batch's id (billed at the model's batch "
        "price factor).",
    )
    is_error = models.BooleanField(
        "failed", default=False, help_text="Counted in errors (UsageEvent.is_error)."
    )
    split = models.CharField(
        max_length=200,
        blank=True,
        default="",
        db_index=True,
        help_text="The split the requested name is (routing splits), if any.",
    )
    split_side = models.CharField(
        "split side",
        max_length=200,
        blank=True,
        default="",
        help_text="The split's side (model) the request was put on.",
    )
    hedged = models.BooleanField(
        default=False,
        help_text="A second attempt raced the first; only the winner is billed.",
    )
    decision = models.TextField(
        blank=True,
        default="",
        help_text="The routing decision as recorded (JSON, capped): what "
        "explaining a past request shows.",
    )
    created_at = models.DateTimeField(db_index=True)
    rolled_up = models.BooleanField(default=False)
    reconciled = models.BooleanField(
        "lost",
        default=False,
        help_text="Its serving process died before the request ended: billed "
        "for what that process had seen last.",
    )

    objects = UsageRecordQuerySet.as_manager()

    class Meta:
        ordering = ("-created_at",)
        verbose_name = "usage record"
        indexes = (
            # The rollup's work queue: small, because rolled-up rows leave it.
            models.Index(
                fields=("id",), condition=Q(rolled_up=False), name="usagerecord_pending"
            ),
        )

    def __str__(self) -> str:
        return f"{self.request_id} {self.backend} / {self.served_model}"


class OpenRequest(models.Model):
    """A request admitted by a serving process and not ended yet (see the module).

    Written by ``usage.flush`` from the process's opens (and progress of long
    streams), deleted with its settle, or by ``usage.lost`` once the process
    stopped beating: then it becomes a ``reconciled`` UsageRecord with the
    same ``event_id``.
    """

    event_id = models.CharField(max_length=32, unique=True)
    process = models.CharField(
        max_length=16, db_index=True, help_text="The serving process's id."
    )
    request_id = models.CharField(max_length=128)
    endpoint = models.CharField(max_length=16, choices=Endpoint.choices)
    api_key_prefix = models.CharField(
        "API key", max_length=PREFIX_LENGTH, blank=True, default=""
    )
    backend = models.CharField(max_length=100, blank=True, default="")
    requested_model = models.CharField(max_length=200, blank=True, default="")
    served_model = models.CharField(max_length=200, blank=True, default="")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    total_tokens = models.PositiveBigIntegerField(default=0)
    cost_nanos = models.PositiveBigIntegerField("cost (nano-USD)", default=0)
    status = models.PositiveSmallIntegerField(
        default=0, help_text="Status sent so far (0: no answer yet)."
    )
    streamed = models.BooleanField(default=False)
    ensemble_id = models.CharField(
        "ensemble",
        max_length=32,
        blank=True,
        default="",
        help_text="The multiple-opinions ensemble it is a step of, if any.",
    )
    batch_id = models.CharField(
        "batch",
        max_length=40,
        blank=True,
        default="",
        help_text="The batch job it is a line of, if any.",
    )
    created_at = models.DateTimeField(help_text="When the request was admitted.")
    seen_at = models.DateTimeField(
        db_index=True, help_text="When its process was last heard of."
    )

    class Meta:
        ordering = ("created_at",)
        verbose_name = "open request"

    def __str__(self) -> str:
        return f"{self.request_id} (open)"
