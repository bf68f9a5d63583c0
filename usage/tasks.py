"""Usage and batch work; each task calls one function (scheduled in settings)."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from usage import lost, rollup, stream
from usage.batches import jobs, runner
from usage.limits import spend
from usage.models import UsageBucket, UsageRecord


@shared_task
def drain_usage_stream() -> int:
    return stream.drain_usage_stream()


@shared_task
def reconcile_lost_usage() -> int:
    return lost.reconcile_lost_usage()


@shared_task
def roll_up_usage() -> int:
    return rollup.roll_up_usage()


@shared_task
def prune_usage_buckets() -> int:
    return UsageBucket.objects.prune(settings.NEXUS_USAGE_RETENTION_DAYS)


@shared_task
def prune_usage_records() -> int:
    return UsageRecord.objects.prune(settings.NEXUS_USAGE_RECORD_RETENTION_HOURS)


@shared_task
def reconcile_key_spend() -> int:
    return spend.reconcile_shared_spend(settings.NEXUS_LIMITS_REDIS_URL)


@shared_task
def run_batch(batch_id: str) -> str:
    return runner.run_batch(batch_id)


@shared_task
def resume_batches() -> int:
    return jobs.resume_batches()
