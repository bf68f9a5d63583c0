"""The batches in the admin and on the dashboard."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tests.factories import ApiKeyFactory, BatchFactory, FileFactory
from usage.models import Batch, File

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:usage_batch_changelist")


def test_the_changelist_shows_progress_owner_rate_and_eta(
    admin_client: Client,
    django_assert_max_num_queries: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = ApiKeyFactory(name="evals")
    now = timezone.now()
    started = now - timedelta(seconds=10)
    for _ in range(3):
        BatchFactory(
            owner_prefix=key.prefix,
            total=100,
            completed=20,
            failed=5,
            in_progress_at=started,
        )
    monkeypatch.setattr(timezone, "now", lambda: now)  # rates at a fixed time
    with django_assert_max_num_queries(12):  # type: ignore[operator]
        page = admin_client.get(CHANGELIST).content.decode()
    assert f"evals ({key.prefix}…)" in page
    assert "25 / 100 (5 failed)" in page
    assert "2.50" in page  # lines per second: 25 lines in 10 s
    assert "0m 30s" in page  # 75 lines left at that rate


def test_the_cancel_action_asks_running_batches_to_stop(admin_client: Client) -> None:
    running, ended = BatchFactory(), BatchFactory(ended=True)
    admin_client.post(
        CHANGELIST,
        {"action": "cancel_batches", "_selected_action": [running.pk, ended.pk]},
    )
    running.refresh_from_db()
    ended.refresh_from_db()
    assert running.status == "cancelling" and running.cancelling_at is not None
    assert ended.status == "completed"


def test_batches_and_files_cannot_be_added_or_edited(admin_client: Client) -> None:
    batch = BatchFactory()
    assert admin_client.get(reverse("admin:usage_batch_add")).status_code == 403
    change = reverse("admin:usage_batch_change", args=[batch.pk])
    assert admin_client.post(change, {"status": "completed"}).status_code == 403
    assert Batch.objects.get(pk=batch.pk).status == "in_progress"


def test_deleting_a_file_in_the_admin_deletes_its_bytes(
    admin_client: Client, settings: object, tmp_path: object
) -> None:
    settings.NEXUS_BATCH_DIR = tmp_path  # type: ignore[attr-defined]
    file = FileFactory()
    stored = tmp_path / file.path  # type: ignore[operator]
    stored.parent.mkdir(parents=True)
    stored.write_bytes(b"{}\n")
    delete = reverse("admin:usage_file_delete", args=[file.pk])
    admin_client.post(delete, {"post": "yes"})
    assert not File.objects.filter(pk=file.pk).exists()
    assert not stored.exists()


def test_the_dashboard_shows_running_batches_and_batch_tokens(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = timezone.now()
    BatchFactory(
        total=10,
        completed=4,
        prompt_tokens=300,
        completion_tokens=200,
        in_progress_at=now - timedelta(seconds=2),
    )
    monkeypatch.setattr(timezone, "now", lambda: now)
    page = admin_client.get(reverse("dashboard")).content.decode()
    assert "1 running at 2.0 lines/s; 500 batch tokens" in page
    assert "4 / 10" in page
