"""Usage of requests whose serving process died: reconciled from their opens.

A serving process hands on an open for every request its pipeline takes,
progress while a long stream goes on, and a beat every
NEXUS_USAGE_PROGRESS_INTERVAL while any request is open (``usage/progress.py``);
the flush keeps them as ``OpenRequest`` rows until the settle comes. A process
killed without warning (SIGKILL, the OOM killer, a lost machine) never
settles its rows, and its beats stop. ``reconcile_lost_usage()`` (beat) turns
the rows not heard of for NEXUS_USAGE_LOST_AFTER into ``UsageRecord`` rows:
``reconciled`` (shown as "lost"), error ``process_lost``, the status sent so
far (0: no answer yet, e.g. still queued), billed the tokens and cost of the
last progress (none for a request that had not reached a backend).

Exactly once: the record takes the open's event id, so a settle that reached
the database first wins, and one that comes after is skipped as a duplicate.
In production the stream is drained first, so that no settle or beat waiting
there is overtaken.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from usage.models import OpenRequest, UsageRecord
from usage.stream import drain_usage_stream

logger = logging.getLogger(__name__)

LOST_ERROR = "process_lost"
RECONCILE_BATCH = 1000


def reconcile_lost_usage(
    lost_after: float | None = None, *, batch_size: int = RECONCILE_BATCH
) -> int:
    """Record the open requests not heard of for `lost_after` seconds as lost.

    Returns how many. `lost_after` defaults to NEXUS_USAGE_LOST_AFTER.
    """
    if settings.NEXUS_USAGE_TRANSPORT == "redis":
        drain_usage_stream()  # beats and settles waiting there are newer
    if lost_after is None:
        lost_after = settings.NEXUS_USAGE_LOST_AFTER
    cutoff = timezone.now() - timedelta(seconds=lost_after)
    reconciled = 0
    while True:
        opens = list(
            OpenRequest.objects.filter(seen_at__lt=cutoff).order_by("id")[:batch_size]
        )
        if not opens:
            break
        with transaction.atomic():
            UsageRecord.objects.bulk_create(
                [_lost_record(row) for row in opens], ignore_conflicts=True
            )
            OpenRequest.objects.filter(pk__in=[row.pk for row in opens]).delete()
        reconciled += len(opens)
        if len(opens) < batch_size:
            break
    if reconciled:
        logger.warning(
            "Recorded %d requests as lost: their serving processes were not heard "
            "of for %g s",
            reconciled,
            lost_after,
        )
    return reconciled


def _lost_record(row: OpenRequest) -> UsageRecord:
    return UsageRecord(
        event_id=row.event_id,
        request_id=row.request_id,
        endpoint=row.endpoint,
        api_key_prefix=row.api_key_prefix,
        backend=row.backend,
        requested_model=row.requested_model,
        served_model=row.served_model,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens,
        total_tokens=row.total_tokens,
        estimated=True,
        latency_ms=max(0.0, (row.seen_at - row.created_at).total_seconds() * 1000),
        cost_nanos=row.cost_nanos,
        status=row.status,
        streamed=row.streamed,
        error=LOST_ERROR,
        is_error=True,
        created_at=row.created_at,
        ensemble_id=row.ensemble_id,
        batch_id=row.batch_id,
        reconciled=True,
    )
