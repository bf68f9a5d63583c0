from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tests.factories import UsageBucketFactory
from usage.models import UsageBucket
from usage.tasks import prune_usage_buckets


@pytest.mark.django_db
def test_prune_deletes_only_buckets_older_than_retention(settings) -> None:
    settings.NEXUS_USAGE_RETENTION_DAYS = 7
    now = timezone.now().replace(second=0, microsecond=0)
    old = UsageBucketFactory(minute=now - timedelta(days=8))
    edge = UsageBucketFactory(minute=now - timedelta(days=6, hours=23))
    fresh = UsageBucketFactory(minute=now)

    assert prune_usage_buckets() == 1

    remaining = set(UsageBucket.objects.values_list("pk", flat=True))
    assert remaining == {edge.pk, fresh.pk}
    assert old.pk not in remaining


def test_beat_schedules_the_prune_task(settings) -> None:
    entry = settings.CELERY_BEAT_SCHEDULE["prune-usage-buckets"]
    assert entry["task"] == prune_usage_buckets.name
