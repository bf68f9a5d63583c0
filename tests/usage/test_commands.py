from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from tests.factories import (
    ApiKeyFactory,
    TokenUsageFactory,
    UsageBucketFactory,
    UsageEventFactory,
    UsageRecordFactory,
)
from usage.buffer import UsageBuffer
from usage.models import TokenUsage, UsageRecord
from usage.stream import RedisShipper, clear_usage_stream

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_flush_usage_writes_shipped_events_and_rolls_everything_up(
    settings: Any,
) -> None:
    UsageRecordFactory.create_batch(2, total_tokens=10)
    if settings.NEXUS_USAGE_TRANSPORT == "redis":
        # What a serving process's shipper put in Redis a moment ago.
        clear_usage_stream()
        shipper = RedisShipper(UsageBuffer())
        shipper.buffer.append(UsageEventFactory(total_tokens=5))
        shipper.flush_on_exit()
        output = run("nexus_flush_usage")
        assert "Wrote 1 usage event from Redis" in output
        assert "Rolled up 3 usage records; 0 pending." in output
        assert TokenUsage.objects.get().total_tokens == 25
    else:
        output = run("nexus_flush_usage")
        assert "write their own usage" in output
        assert "Rolled up 2 usage records; 0 pending." in output
        assert TokenUsage.objects.get().total_tokens == 20
    assert not UsageRecord.objects.pending().exists()


def test_flush_usage_json_reports_counts(settings: Any) -> None:
    if settings.NEXUS_USAGE_TRANSPORT == "redis":
        clear_usage_stream()
    UsageRecordFactory()

    result = json.loads(run("nexus_flush_usage", "--json"))

    assert result == {"flushed": 0, "rolled_up": 1, "pending": 0}


def _buckets() -> None:
    now = timezone.now().replace(second=0, microsecond=0)
    ApiKeyFactory(name="ci-bot", raw_key="nx-cibot000-secret")
    UsageBucketFactory(
        minute=now - timedelta(minutes=10),
        backend="gpu-1",
        model="llama3:8b",
        api_key_prefix="nx-cibot000",
        requests=4,
        errors=1,
        prompt_tokens=300,
        completion_tokens=100,
        total_tokens=400,
        estimated_tokens=100,
        estimated_requests=1,
    )
    UsageBucketFactory(
        minute=now - timedelta(hours=2),
        backend="gpu-2",
        model="llama3:8b",
        requests=1,
        prompt_tokens=50,
        completion_tokens=50,
        total_tokens=100,
    )
    UsageBucketFactory(
        minute=now - timedelta(days=3),
        backend="gpu-2",
        model="mistral:7b",
        requests=9,
        total_tokens=9000,
    )


def test_usage_prints_a_table_per_model_for_the_last_day() -> None:
    _buckets()

    output = run("nexus_usage")

    lines = output.splitlines()
    assert lines[0].startswith("Usage by model, since ")
    header = lines[1].split()
    assert header == [
        "model",
        "requests",
        "errors",
        "prompt",
        "cached",
        "cache-write",
        "completion",
        "total",
        "cost",
        "(USD)",
        "estimated",
        "cache",
        "hits",
        "saved",
    ]
    assert lines[3].split() == [
        "llama3:8b", "5", "1", "350", "0", "0", "150", "500", "0.0000", "20%",
        "0", "(0%)", "0",
    ]  # fmt: skip
    assert lines[-1].split() == [
        "total", "5", "1", "350", "0", "0", "150", "500", "0.0000", "20%",
        "0", "(0%)", "0",
    ]  # fmt: skip
    assert "mistral" not in output  # three days old


def test_usage_groups_by_key_and_names_the_key() -> None:
    _buckets()

    output = run("nexus_usage", "--by", "key", "--since", "30m")

    assert "ci-bot (nx-cibot000…)" in output
    assert "anonymous" not in output  # the anonymous request is two hours old


def test_usage_by_key_marks_deleted_keys_as_the_admin_does() -> None:
    TokenUsageFactory(api_key_prefix="nx-gone0000", total_tokens=5)
    TokenUsageFactory(api_key_prefix="", total_tokens=3)

    output = run("nexus_usage", "--by", "key", "--since", "all")

    assert "nx-gone0000… (deleted)" in output
    assert "anonymous" in output


def test_usage_json_for_scripts() -> None:
    _buckets()

    result = json.loads(
        run("nexus_usage", "--by", "backend", "--since", "7d", "--json")
    )

    rows = {row["backend"]: row for row in result["rows"]}
    assert rows["gpu-2"]["total_tokens"] == 9100
    assert rows["gpu-1"]["estimated_share"] == 0.25
    assert rows["gpu-1"]["requests"] == 4
    assert result["by"] == "backend"


def test_usage_since_all_reads_the_all_time_totals() -> None:
    TokenUsageFactory(model="old-model", total_tokens=123456)

    output = run("nexus_usage", "--since", "all")

    assert "all time" in output
    assert "old-model" in output and "123,456" in output


def test_usage_mentions_requests_not_rolled_up_yet() -> None:
    UsageRecordFactory()

    output = run("nexus_usage")

    assert "No usage since" in output
    assert "1 more request not rolled up yet" in output


def test_usage_rejects_a_bad_period() -> None:
    with pytest.raises(CommandError, match="not a duration back from now"):
        run("nexus_usage", "--since", "yesterday")


@pytest.mark.django_db
def test_create_key_sets_allow_list_limits_budgets_and_expiry() -> None:
    from usage.models import ApiKey

    out = StringIO()
    call_command(
        "nexus_create_key",
        "team-a",
        "--models=llama3:*,gpt-4",
        "--rpm=60",
        "--tpm=10000",
        "--max-concurrency=4",
        "--budget-tokens=1000000",
        "--budget-usd=12.5",
        "--budget-period=day",
        "--expires=2030-01-31",
        "--json",
        stdout=out,
    )

    key = ApiKey.objects.get(prefix=json.loads(out.getvalue())["prefix"])
    assert key.model_patterns == ("llama3:*", "gpt-4")
    assert (key.rpm_limit, key.tpm_limit, key.max_concurrency) == (60, 10000, 4)
    assert key.budget_tokens == 1_000_000 and key.budget_period == "day"
    assert key.budget_nanos == 12_500_000_000
    assert key.expires_at is not None and key.expires_at.isoformat() == (
        "2030-01-31T00:00:00+00:00"
    )


@pytest.mark.django_db
def test_create_key_refuses_a_bad_limit_with_a_message() -> None:
    with pytest.raises(CommandError, match="rpm_limit"):
        call_command("nexus_create_key", "bad", "--rpm=0", stdout=StringIO())
    with pytest.raises(CommandError, match="--expires"):
        call_command("nexus_create_key", "bad", "--expires=soon", stdout=StringIO())


def test_usage_shows_cache_hits_and_tokens_saved() -> None:
    now = timezone.now()
    UsageBucketFactory(
        minute=now - timedelta(minutes=5),
        backend="",
        model="llama3:8b",
        requests=4,
        total_tokens=400,
        cache_hits=1,
        cache_saved_tokens=100,
    )
    lines = run("nexus_usage").splitlines()
    assert lines[3].split()[-3:] == ["1", "(25%)", "100"]
    rows = json.loads(run("nexus_usage", "--json"))["rows"]
    assert rows[0]["cache_hits"] == 1 and rows[0]["cache_hit_rate"] == 0.25
    assert rows[0]["cache_saved_tokens"] == 100
