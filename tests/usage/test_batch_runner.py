"""Which runner may take a batch: one per batch, bounded per key and in all."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from tests.factories import BatchFactory
from usage.batches import runner
from usage.models import Batch

pytestmark = pytest.mark.django_db


def test_a_batch_held_by_a_live_runner_is_not_taken() -> None:
    batch = BatchFactory(
        lease_owner="other", lease_until=timezone.now() + timedelta(seconds=30)
    )
    assert runner._claim(batch.id, "me") is None
    Batch.objects.filter(pk=batch.pk).update(
        lease_until=timezone.now() - timedelta(seconds=1)
    )
    claimed = runner._claim(batch.id, "me")  # its runner died: the lease ran out
    assert claimed is not None and claimed.lease_owner == "me"


def test_a_key_runs_at_most_its_share_of_batches_at_once(settings: Any) -> None:
    settings.NEXUS_BATCH_KEY_BATCHES = 1
    settings.NEXUS_BATCH_RUNNING = 10
    running = BatchFactory(owner_prefix="nx-a")
    waiting, other_key = (
        BatchFactory(owner_prefix="nx-a"),
        BatchFactory(owner_prefix="nx-b"),
    )
    assert runner._claim(running.id, "r1") is not None
    assert runner._claim(waiting.id, "r2") is None  # waits for the first
    assert runner._claim(other_key.id, "r3") is not None
    settings.NEXUS_BATCH_RUNNING = 2
    Batch.objects.filter(pk=other_key.pk).update(lease_until=None)
    third = BatchFactory(owner_prefix="nx-c")
    assert runner._claim(other_key.id, "r3") is not None
    assert runner._claim(third.id, "r4") is None  # two run already in all


def test_an_ended_batch_is_never_taken() -> None:
    assert runner._claim(BatchFactory(ended=True).id, "me") is None
    assert runner._claim("batch_missing", "me") is None


def test_a_batch_whose_input_file_is_gone_fails(settings: Any, tmp_path: Any) -> None:
    settings.NEXUS_BATCH_DIR = tmp_path
    batch = BatchFactory()
    assert runner.run_batch(batch.id) == "failed"
    batch.refresh_from_db()
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors[0]["code"] == "input_file_missing"
    assert batch.lease_owner == ""
