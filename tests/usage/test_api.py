from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from tests.factories import (
    ApiKeyFactory,
    StaffUserFactory,
    TokenUsageFactory,
    UsageBucketFactory,
    UsageRecordFactory,
)

pytestmark = pytest.mark.django_db


def _this_minute() -> datetime:
    return timezone.now().replace(second=0, microsecond=0)


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(StaffUserFactory())
    return client


@pytest.fixture
def buckets() -> datetime:
    """Two hours of usage for two keys (one anonymous) on two backends, up to
    this minute (of the test, not of the collection: a long run must not move
    the buckets out of a relative range), which it returns."""
    now = _this_minute()
    ApiKeyFactory(name="ci-bot", raw_key="nx-cibot000-secret")
    common = {"prompt_tokens": 60, "completion_tokens": 40, "total_tokens": 100}
    UsageBucketFactory(
        minute=now - timedelta(minutes=5),
        backend="gpu-1",
        model="llama3:8b",
        api_key_prefix="nx-cibot000",
        requests=2,
        errors=1,
        estimated_requests=1,
        estimated_tokens=50,
        latency_ms_sum=300.0,
        **common,
    )
    UsageBucketFactory(
        minute=now - timedelta(minutes=50),
        backend="gpu-1",
        model="llama3:8b",
        api_key_prefix="nx-cibot000",
        requests=1,
        latency_ms_sum=100.0,
        **common,
    )
    UsageBucketFactory(
        minute=now - timedelta(minutes=30),
        backend="gpu-2",
        model="mistral:7b",
        api_key_prefix="",
        requests=5,
        latency_ms_sum=1000.0,
        **common,
    )
    UsageBucketFactory(
        minute=now - timedelta(days=2),
        backend="gpu-2",
        model="llama3:8b",
        api_key_prefix="",
        requests=1,
        **common,
    )
    return now


def test_tokens_without_a_range_are_the_all_time_totals(api: APIClient) -> None:
    TokenUsageFactory(backend="gpu-1", model="big", total_tokens=900, requests=3)
    TokenUsageFactory(backend="gpu-2", model="small", total_tokens=10, requests=1)

    body = api.get("/api/v1/usage/tokens").json()

    assert body["count"] == 2
    first = body["results"][0]
    assert (first["backend"], first["model"], first["total_tokens"]) == (
        "gpu-1",
        "big",
        900,
    )
    assert first["key"] == "" and first["key_name"] is None


@pytest.mark.usefixtures("buckets")
def test_tokens_over_a_range_sum_the_buckets_per_series(api: APIClient) -> None:
    body = api.get("/api/v1/usage/tokens", {"since": "1h"}).json()

    rows = {(r["backend"], r["model"], r["key"]): r for r in body["results"]}
    assert set(rows) == {
        ("gpu-1", "llama3:8b", "nx-cibot000"),
        ("gpu-2", "mistral:7b", ""),
    }
    bot = rows["gpu-1", "llama3:8b", "nx-cibot000"]
    assert (bot["requests"], bot["errors"], bot["total_tokens"]) == (3, 1, 200)
    assert (bot["estimated_requests"], bot["estimated_tokens"]) == (1, 50)
    assert bot["latency_ms_avg"] == round(400 / 3, 1)
    assert bot["key_name"] == "ci-bot"


@pytest.mark.parametrize(
    ("params", "expected_requests"),
    [
        ({"since": "1h", "backend": "gpu-1"}, 3),
        ({"since": "1h", "model": "mistral:7b"}, 5),
        ({"since": "1h", "key": "-"}, 5),
        ({"since": "1h", "key": "nx-cibot000"}, 3),
        ({"since": "10m"}, 2),
        (
            {
                "since": "3d",
                "until": lambda now: (now - timedelta(minutes=40)).isoformat(),
            },
            2,
        ),
        ({"since": "3d"}, 9),
        ({"since": lambda now: (now - timedelta(hours=1)).date().isoformat()}, 8),
    ],
)
def test_tokens_filters(
    api: APIClient,
    buckets: datetime,
    params: dict[str, str | Callable[[datetime], str]],
    expected_requests: int,
) -> None:
    query = {k: v(buckets) if callable(v) else v for k, v in params.items()}
    body = api.get("/api/v1/usage/tokens", query).json()

    assert sum(row["requests"] for row in body["results"]) == expected_requests


@pytest.mark.usefixtures("buckets")
def test_tokens_grouped_by_model_only(api: APIClient) -> None:
    body = api.get("/api/v1/usage/tokens", {"since": "3d", "by": "model"}).json()

    assert [(r["model"], r["requests"]) for r in body["results"]] == [
        ("llama3:8b", 4),
        ("mistral:7b", 5),
    ]
    assert body["results"][0]["backend"] is None
    assert body["results"][0]["key"] is None


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"since": "yesterday"}, "since"),
        ({"until": "2026-02-30"}, "until"),
        ({"since": "1h", "until": "2h"}, "until"),
        ({"by": "colour"}, "by"),
        ({"by": ","}, "by"),
    ],
)
def test_tokens_reject_bad_parameters_with_field_errors(
    api: APIClient, params: dict[str, str], field: str
) -> None:
    response = api.get("/api/v1/usage/tokens", params)

    assert response.status_code == 400
    assert response.json()[field]


def test_tokens_page_and_bound_their_queries(
    api: APIClient, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    for n in range(30):
        TokenUsageFactory(api_key_prefix=f"nx-{n:08d}", total_tokens=1000 - n)
        ApiKeyFactory(raw_key=f"nx-{n:08d}-secret")

    with django_assert_max_num_queries(3):
        page = api.get("/api/v1/usage/tokens", {"limit": 10, "offset": 10}).json()

    assert page["count"] == 30
    assert [r["total_tokens"] for r in page["results"]] == list(range(990, 980, -1))
    assert all(r["key_name"] for r in page["results"])


@pytest.mark.usefixtures("buckets")
def test_stats_per_model_and_backend_over_the_last_day(api: APIClient) -> None:
    UsageRecordFactory()  # recorded, not rolled up yet

    body = api.get("/api/v1/usage/stats").json()

    totals = body["totals"]
    assert (totals["requests"], totals["errors"], totals["total_tokens"]) == (
        8,
        1,
        300,
    )
    assert totals["error_rate"] == 0.125
    assert totals["latency_ms_avg"] == 175.0
    assert {r["model"]: r["requests"] for r in body["by_model"]} == {
        "llama3:8b": 3,
        "mistral:7b": 5,
    }
    assert {r["backend"]: r["total_tokens"] for r in body["by_backend"]} == {
        "gpu-1": 200,
        "gpu-2": 100,
    }
    pairs = {(r["backend"], r["model"]): r for r in body["by_backend_model"]}
    assert pairs["gpu-2", "mistral:7b"]["latency_ms_avg"] == 200.0
    assert body["pending_records"] == 1


@pytest.mark.usefixtures("buckets")
def test_stats_over_a_chosen_range_and_backend(api: APIClient) -> None:
    body = api.get("/api/v1/usage/stats", {"since": "3d", "backend": "gpu-2"}).json()

    assert body["totals"]["requests"] == 6
    assert [r["backend"] for r in body["by_backend"]] == ["gpu-2"]
