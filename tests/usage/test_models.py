"""Client API keys: only a hash is stored, and only active keys resolve."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from tests.factories import ApiKeyFactory, TokenUsageFactory, UsageBucketFactory
from usage.models import (
    ApiKey,
    TokenUsage,
    UsageBucket,
    describe_key,
    hash_key,
    select_usage_rows,
)


def _stored_text(key: ApiKey) -> str:
    return " ".join(
        str(value) for value in ApiKey.objects.filter(pk=key.pk).values().get().values()
    )


@pytest.mark.django_db
def test_create_key_stores_a_hash_and_a_short_prefix_only() -> None:
    key, raw = ApiKey.objects.create_key("ci")

    assert raw.startswith("nx-") and len(raw) > 40
    assert key.prefix == raw[:11]
    assert key.hashed_key == hashlib.sha256(raw.encode()).hexdigest()
    assert raw not in _stored_text(key)
    assert raw[11:] not in _stored_text(key)


@pytest.mark.django_db
def test_each_created_key_is_different() -> None:
    raws = {ApiKey.objects.create_key(f"key-{n}")[1] for n in range(5)}

    assert len(raws) == 5


@pytest.mark.django_db
def test_for_raw_key_finds_the_active_key() -> None:
    key, raw = ApiKey.objects.create_key("ci")

    assert ApiKey.objects.for_raw_key(raw) == key
    assert key.matches(raw)


@pytest.mark.django_db
def test_for_raw_key_ignores_inactive_keys() -> None:
    key = ApiKeyFactory(raw_key="nx-test-inactive-secret", is_active=False)

    assert key.matches("nx-test-inactive-secret")
    assert ApiKey.objects.for_raw_key("nx-test-inactive-secret") is None


@pytest.mark.django_db
def test_for_raw_key_rejects_wrong_or_partial_keys() -> None:
    key, raw = ApiKey.objects.create_key("ci")

    assert ApiKey.objects.for_raw_key(raw + "x") is None
    assert ApiKey.objects.for_raw_key(key.prefix) is None
    assert ApiKey.objects.for_raw_key(key.hashed_key) is None
    assert ApiKey.objects.for_raw_key("") is None


def test_hash_key_is_sha256_hex() -> None:
    assert hash_key("nx-abc") == hashlib.sha256(b"nx-abc").hexdigest()


@pytest.mark.django_db
def test_two_keys_cannot_share_a_hash() -> None:
    ApiKeyFactory(raw_key="nx-test-same-secret")

    with pytest.raises(IntegrityError), transaction.atomic():
        ApiKey.objects.create(
            name="copy",
            prefix="nx-other000",
            hashed_key=hash_key("nx-test-same-secret"),
        )


@pytest.mark.django_db
def test_token_usage_has_one_row_per_backend_model_and_key() -> None:
    TokenUsageFactory(backend="gpu-1", model="llama3:8b", api_key_prefix="nx-abc")

    with pytest.raises(IntegrityError), transaction.atomic():
        TokenUsage.objects.create(
            backend="gpu-1", model="llama3:8b", api_key_prefix="nx-abc"
        )


# --- the usage report -----------------------------------------------------------


@pytest.mark.django_db
def test_report_sums_each_series_and_derives_rates() -> None:
    TokenUsageFactory(
        backend="gpu-1",
        model="llama3:8b",
        api_key_prefix="nx-a0000000",
        requests=3,
        errors=1,
        total_tokens=100,
        estimated_tokens=25,
        latency_ms_sum=300.0,
    )
    TokenUsageFactory(
        backend="gpu-2",
        model="llama3:8b",
        requests=1,
        total_tokens=300,
        latency_ms_sum=100.0,
    )

    [row] = TokenUsage.objects.report(["model"])

    assert row["model"] == "llama3:8b"
    assert (row["requests"], row["errors"], row["total_tokens"]) == (4, 1, 400)
    assert row["latency_ms_avg"] == 100.0
    assert row["error_rate"] == 0.25
    assert row["estimated_share"] == 25 / 400
    assert "key_name" not in row


@pytest.mark.django_db
def test_report_puts_the_largest_total_first_and_pages_in_the_database() -> None:
    for tokens in (10, 30, 20):
        TokenUsageFactory(model=f"m-{tokens}", total_tokens=tokens)

    rows = TokenUsage.objects.report(["model"])

    assert [row["model"] for row in rows] == ["m-30", "m-20", "m-10"]
    assert rows.count() == 3
    assert [row["model"] for row in rows[1:2]] == ["m-20"]
    assert rows[1:2][0]["latency_ms_avg"] is not None


@pytest.mark.django_db
def test_report_by_key_names_each_key() -> None:
    key = ApiKeyFactory(name="ci-bot")
    TokenUsageFactory(api_key_prefix=key.prefix, total_tokens=3)
    TokenUsageFactory(api_key_prefix="", total_tokens=2)
    TokenUsageFactory(api_key_prefix="nx-gone0000", total_tokens=1)

    rows = TokenUsage.objects.report(["key"])

    assert [(r["api_key_prefix"], r["key_name"]) for r in rows] == [
        (key.prefix, "ci-bot"),
        ("", None),
        ("nx-gone0000", None),
    ]
    assert [describe_key(r["api_key_prefix"], r["key_name"]) for r in rows] == [
        f"ci-bot ({key.prefix}…)",
        "anonymous",
        "nx-gone0000… (deleted)",
    ]


@pytest.mark.django_db
def test_report_of_idle_series_has_no_mean_latency() -> None:
    TokenUsageFactory(requests=0, errors=0, total_tokens=0)

    [row] = TokenUsage.objects.report(["backend"])

    assert row["latency_ms_avg"] is None
    assert row["error_rate"] == 0.0
    assert row["estimated_share"] == 0.0


@pytest.mark.django_db
def test_totals_are_zeros_without_rows() -> None:
    totals = UsageBucket.objects.all().totals()

    assert totals["requests"] == totals["total_tokens"] == 0
    assert totals["latency_ms_avg"] is None
    assert totals["error_rate"] == 0.0


@pytest.mark.django_db
def test_usage_rows_of_a_range_are_the_minute_buckets_in_it() -> None:
    now = timezone.now().replace(second=0, microsecond=0)
    TokenUsageFactory(requests=100)
    UsageBucketFactory(minute=now - timedelta(minutes=5), requests=2)
    UsageBucketFactory(minute=now - timedelta(hours=5), requests=7)

    all_time = select_usage_rows().totals()
    last_hour = select_usage_rows(now - timedelta(hours=1)).totals()
    until = select_usage_rows(until=now - timedelta(hours=1)).totals()

    assert (all_time["requests"], last_hour["requests"], until["requests"]) == (
        100,
        2,
        7,
    )
