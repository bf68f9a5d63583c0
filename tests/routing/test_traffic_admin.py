"""Admin pages for splits, shadows (with their comparisons) and hedging."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from routing.models import Hedging, Shadow, ShadowComparison, TrafficSplit
from routing.snapshot import build_snapshot
from usage.models import UsageRecord

pytestmark = pytest.mark.django_db

SPLIT_ADD = reverse("admin:routing_trafficsplit_add")


def split_form(name: str, targets: list[tuple[str, str]]) -> dict[str, str]:
    data = {
        "name": name,
        "sticky": "key",
        "targets-TOTAL_FORMS": str(len(targets)),
        "targets-INITIAL_FORMS": "0",
        "targets-MIN_NUM_FORMS": "1",
        "targets-MAX_NUM_FORMS": "1000",
    }
    for index, (model, weight) in enumerate(targets):
        data[f"targets-{index}-position"] = str(index)
        data[f"targets-{index}-model"] = model
        data[f"targets-{index}-weight"] = weight
    return data


def test_a_split_made_in_the_admin_is_routed(admin_client: Client) -> None:
    response = admin_client.post(
        SPLIT_ADD, split_form("chat", [("llama3:8b", "90"), ("qwen2.5:7b", "10")])
    )
    assert response.status_code == 302, response.content
    split = build_snapshot().splits["chat"]
    assert [(s.model, s.weight) for s in split.sides] == [
        ("llama3:8b", 90),
        ("qwen2.5:7b", 10),
    ]


def test_split_rules_show_on_the_form(admin_client: Client) -> None:
    itself = admin_client.post(SPLIT_ADD, split_form("chat", [("chat", "1")]))
    assert "cannot target itself" in itself.content.decode()
    zero = admin_client.post(SPLIT_ADD, split_form("chat", [("a", "0")]))
    assert zero.status_code == 200
    assert not TrafficSplit.objects.exists()


def test_the_split_page_compares_its_sides(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    split = TrafficSplit.objects.create(name="chat")
    split.set_targets({"llama3:8b": 90, "qwen2.5:7b": 10})
    now = timezone.now()
    for n, (side, latency, status) in enumerate(
        [("llama3:8b", 100.0, 200)] * 3
        + [("qwen2.5:7b", 300.0, 200), ("qwen2.5:7b", 500.0, 500)]
    ):
        UsageRecord.objects.create(
            event_id=f"e{n}",
            request_id=f"r{n}",
            endpoint="chat",
            requested_model="chat",
            served_model=side,
            split="chat",
            split_side=side,
            latency_ms=latency,
            status=status,
            is_error=status >= 400,
            prompt_tokens=10,
            completion_tokens=5,
            created_at=now - timedelta(minutes=n),
        )
    with django_assert_max_num_queries(20):
        page = admin_client.get(
            reverse("admin:routing_trafficsplit_change", args=(split.pk,))
        ).content.decode()
    assert "split-sides" in page
    row = "<td>qwen2.5:7b</td><td>2</td><td>1 (50%)</td><td>300.0</td><td>500.0</td>"
    assert row in page
    with django_assert_max_num_queries(10):
        listing = admin_client.get(reverse("admin:routing_trafficsplit_changelist"))
    assert "llama3:8b 90 (90%)" in listing.content.decode()
    # The dashboard compares them too.
    dashboard = admin_client.get("/dashboard/").content.decode()
    assert (
        '<td>chat</td><td>qwen2.5:7b</td><td class="num">2</td>'
        '<td class="num">1</td><td class="num">300.0</td><td class="num">500.0</td>'
    ) in dashboard


def test_the_shadow_page_lists_comparisons_and_shows_both_answers(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    shadow = Shadow.objects.create(model="llama3:8b", shadow_model="qwen2.5:7b")
    comparison = ShadowComparison.objects.create(
        shadow=shadow,
        request_id="req-1",
        created_at=datetime(2026, 11, 29, 12, tzinfo=UTC),
        prompt="what is 2+2?",
        primary_model="llama3:8b",
        primary_answer="It is <b>4</b>.",
        shadow_answer="Four.",
        similarity=0.25,
        primary_latency_ms=80,
        shadow_latency_ms=800,
    )
    with django_assert_max_num_queries(10):
        listing = admin_client.get(reverse("admin:routing_shadow_changelist"))
    assert "0.25" in listing.content.decode()
    page = admin_client.get(
        reverse("admin:routing_shadow_change", args=(shadow.pk,))
    ).content.decode()
    assert "req-1" in page
    assert "80 / 800" in page
    detail = admin_client.get(
        reverse("admin:routing_shadowcomparison_change", args=(comparison.pk,))
    ).content.decode()
    # Both answers side by side, escaped.
    assert "It is &lt;b&gt;4&lt;/b&gt;." in detail
    assert '<pre class="shadow-answer">Four.</pre>' in detail


def test_hedging_is_edited_in_the_admin(admin_client: Client) -> None:
    response = admin_client.post(
        reverse("admin:routing_hedging_add"),
        {
            "model": "llama3:8b",
            "after": "p95",
            "after_ms": "200",
            "max_extra": "1",
            "max_body_bytes": "65536",
        },
    )
    assert response.status_code == 302, response.content
    assert Hedging.objects.get().after == "p95"
    bad = admin_client.post(
        reverse("admin:routing_hedging_add"),
        {
            "model": "m",
            "after": "fixed",
            "after_ms": "200",
            "max_extra": "9",
            "max_body_bytes": "1",
        },
    )
    assert bad.status_code == 200
    assert Hedging.objects.count() == 1
