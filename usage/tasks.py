from __future__ import annotations

from celery import shared_task
from django.conf import settings

from usage.models import UsageBucket


@shared_task
def prune_usage_buckets() -> int:
    return UsageBucket.objects.prune(settings.NEXUS_USAGE_RETENTION_DAYS)
