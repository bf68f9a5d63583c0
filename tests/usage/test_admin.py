"""Admin pages for client API keys and the read-only usage tables."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tests.factories import ApiKeyFactory, TokenUsageFactory, UsageBucketFactory
from usage.models import ApiKey, TokenUsage, UsageBucket, hash_key

pytestmark = pytest.mark.django_db

KEY_CHANGELIST = reverse("admin:usage_apikey_changelist")
KEY_ADD = reverse("admin:usage_apikey_add")
TOKEN_USAGE = reverse("admin:usage_tokenusage_changelist")
BUCKETS = reverse("admin:usage_usagebucket_changelist")
RAW_KEY_IN_MESSAGE = re.compile(r"<code>(nx-[A-Za-z0-9_-]+)</code>")


def create_keys(count: int) -> list[ApiKey]:
    """Create keys with distinct prefixes (the factory's first ten share one)."""
    return [
        ApiKeyFactory(raw_key=f"nx-{index:08d}-secret-for-admin-tests")
        for index in range(count)
    ]


def key_change_url(key: ApiKey) -> str:
    return reverse("admin:usage_apikey_change", args=(key.pk,))


def listed(response: Any) -> list[Any]:
    return list(response.context["cl"].result_list)


# --- API keys -----------------------------------------------------------------


def test_api_key_pages_render_for_a_superuser(admin_client: Client) -> None:
    key = ApiKeyFactory()

    for url in (
        KEY_CHANGELIST,
        KEY_ADD,
        key_change_url(key),
        reverse("admin:usage_apikey_history", args=(key.pk,)),
    ):
        assert admin_client.get(url).status_code == 200, url


def test_add_form_asks_for_a_name_and_the_keys_limits(admin_client: Client) -> None:
    form = admin_client.get(KEY_ADD).context["adminform"].form

    assert list(form.fields) == [
        "name",
        "team",
        "allowed_models",
        "expires_at",
        "rpm_limit",
        "tpm_limit",
        "max_concurrency",
        "budget_period",
        "budget_tokens",
        "budget_usd",
        "can_manage_models",
    ]


def test_a_key_is_created_with_its_limits(admin_client: Client) -> None:
    admin_client.post(
        KEY_ADD,
        {
            "name": "limited",
            "allowed_models": "llama3:*, gpt-4",
            "rpm_limit": "60",
            "budget_period": "day",
            "budget_usd": "2.5",
        },
    )

    key = ApiKey.objects.get(name="limited")
    assert key.model_patterns == ("llama3:*", "gpt-4")
    assert key.rpm_limit == 60 and key.budget_period == "day"
    assert key.budget_nanos == 2_500_000_000


def test_new_key_is_shown_once_and_only_its_hash_is_stored(
    admin_client: Client,
) -> None:
    response = admin_client.post(
        KEY_ADD,
        {"name": "ci-runner", "budget_period": "month", "_continue": "1"},
        follow=True,
    )

    assert response.status_code == 200
    match = RAW_KEY_IN_MESSAGE.search(response.content.decode())
    assert match, "the new key is not in the admin message"
    raw_key = match.group(1)
    key = ApiKey.objects.get(name="ci-runner")
    assert key.hashed_key == hash_key(raw_key)
    assert key.prefix == raw_key[: len(key.prefix)]
    stored = [str(value) for value in ApiKey.objects.values().get().values()]
    assert raw_key not in stored
    assert ApiKey.objects.for_raw_key(raw_key) == key
    # Shown once: the key's own page, reloaded, has neither the key nor its hash.
    again = admin_client.get(key_change_url(key)).content.decode()
    assert raw_key not in again
    assert key.hashed_key not in again
    assert key.prefix in again
    assert raw_key not in admin_client.get(KEY_CHANGELIST).content.decode()


def test_key_hash_is_never_displayed(admin_client: Client) -> None:
    key = ApiKeyFactory()

    for url in (KEY_CHANGELIST, key_change_url(key)):
        assert key.hashed_key not in admin_client.get(url).content.decode()


def test_prefix_and_hash_cannot_be_changed(admin_client: Client) -> None:
    key = ApiKeyFactory(name="old")
    prefix, hashed = key.prefix, key.hashed_key

    response = admin_client.post(
        key_change_url(key),
        {
            "name": "renamed",
            "is_active": "on",
            "budget_period": "month",
            "prefix": "nx-evil0000",
            "hashed_key": "0" * 64,
            "admission_weight": "1",
            "max_criticality": "default",
        },
    )

    assert response.status_code == 302
    key.refresh_from_db()
    assert (key.name, key.prefix, key.hashed_key) == ("renamed", prefix, hashed)


def test_a_keys_fair_share_and_highest_criticality_are_edited(
    admin_client: Client,
) -> None:
    key = ApiKeyFactory(name="batch")
    form = {
        "name": "batch",
        "is_active": "on",
        "admission_weight": "3",
        "budget_period": "month",
    }

    response = admin_client.post(
        key_change_url(key), {**form, "max_criticality": "critical"}
    )
    assert response.status_code == 302
    key.refresh_from_db()
    assert (key.admission_weight, key.max_criticality) == (3.0, "critical")

    refused = admin_client.post(
        key_change_url(key),
        {**form, "admission_weight": "0", "max_criticality": "urgent"},
    )
    errors = refused.context["adminform"].form.errors
    assert set(errors) == {"admission_weight", "max_criticality"}


def test_deactivate_action_turns_keys_off(admin_client: Client) -> None:
    kept, first, second = create_keys(3)

    response = admin_client.post(
        KEY_CHANGELIST,
        {"action": "deactivate_keys", "_selected_action": [first.pk, second.pk]},
        follow=True,
    )

    assert "Deactivated 2 keys." in response.content.decode()
    assert set(ApiKey.objects.filter(is_active=True)) == {kept}
    assert ApiKey.objects.for_raw_key("nx-00000001-secret-for-admin-tests") is None


def test_key_page_shows_its_usage(admin_client: Client) -> None:
    key = ApiKeyFactory()
    TokenUsageFactory(
        api_key_prefix=key.prefix, backend="gpu-1", model="llama3:8b", requests=7
    )
    TokenUsageFactory(api_key_prefix=key.prefix, backend="gpu-2", model="phi3")
    TokenUsageFactory(api_key_prefix="nx-other000", backend="gpu-3", model="qwen2")

    html = admin_client.get(key_change_url(key)).content.decode()

    assert "llama3:8b" in html and "phi3" in html
    assert "qwen2" not in html
    assert "10 requests, 0 errors, 84 tokens, $0.0000 in all" in html
    link = re.search(r'href="([^"]*api_key_prefix=[^"]*)"', html)
    assert link
    usage = admin_client.get(link.group(1).replace("&amp;", "&"))
    assert {(row.backend, row.model) for row in listed(usage)} == {
        ("gpu-1", "llama3:8b"),
        ("gpu-2", "phi3"),
    }


def test_key_page_says_when_there_is_no_usage(admin_client: Client) -> None:
    html = admin_client.get(key_change_url(ApiKeyFactory())).content.decode()

    assert "No usage recorded for this key yet." in html


def test_key_changelist_query_count_does_not_grow_with_rows(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    create_keys(40)

    with django_assert_max_num_queries(8):
        response = admin_client.get(KEY_CHANGELIST)

    assert len(listed(response)) == 40


# --- usage tables -------------------------------------------------------------


@pytest.mark.parametrize("model_name", ["tokenusage", "usagebucket"])
def test_usage_tables_are_viewable_but_read_only(
    admin_client: Client, model_name: str
) -> None:
    row = (TokenUsageFactory if model_name == "tokenusage" else UsageBucketFactory)()
    model = type(row)
    change = reverse(f"admin:usage_{model_name}_change", args=(row.pk,))
    add_url = reverse(f"admin:usage_{model_name}_add")

    listing = admin_client.get(reverse(f"admin:usage_{model_name}_changelist"))
    view = admin_client.get(change)
    add = admin_client.get(add_url)
    edit = admin_client.post(change, {"requests": "999", "backend": "x"})
    delete = admin_client.post(
        reverse(f"admin:usage_{model_name}_delete", args=(row.pk,)), {"post": "yes"}
    )

    assert listing.status_code == 200
    assert add_url not in listing.content.decode()
    assert 'name="action"' not in listing.content.decode()
    assert view.status_code == 200
    assert 'name="_save"' not in view.content.decode()
    assert add.status_code == 403
    assert edit.status_code == 403
    assert delete.status_code == 403
    row.refresh_from_db()
    assert row.requests != 999
    assert model.objects.count() == 1


def test_usage_rows_name_their_key(admin_client: Client) -> None:
    key = ApiKeyFactory(name="ci-runner")
    TokenUsageFactory(api_key_prefix=key.prefix)
    TokenUsageFactory(api_key_prefix="")
    TokenUsageFactory(api_key_prefix="nx-gone0000")

    html = admin_client.get(TOKEN_USAGE).content.decode()

    assert f"ci-runner ({key.prefix}…)" in html
    assert key_change_url(key) in html
    assert "anonymous" in html
    assert "nx-gone0000… (deleted)" in html


def test_token_usage_filters_by_backend_model_and_key(admin_client: Client) -> None:
    key = ApiKeyFactory()
    TokenUsageFactory(backend="gpu-1", model="llama3:8b", api_key_prefix=key.prefix)
    TokenUsageFactory(backend="gpu-1", model="phi3", api_key_prefix="")
    TokenUsageFactory(backend="gpu-2", model="llama3:8b", api_key_prefix="")

    def series(**params: str) -> set[tuple[str, str, str]]:
        response = admin_client.get(TOKEN_USAGE, params)
        assert response.status_code == 200
        return {(r.backend, r.model, r.api_key_prefix) for r in listed(response)}

    assert series(backend="gpu-2") == {("gpu-2", "llama3:8b", "")}
    assert series(model="llama3:8b") == {
        ("gpu-1", "llama3:8b", key.prefix),
        ("gpu-2", "llama3:8b", ""),
    }
    assert series(api_key_prefix=key.prefix) == {("gpu-1", "llama3:8b", key.prefix)}
    assert series(api_key_prefix="-") == {
        ("gpu-1", "phi3", ""),
        ("gpu-2", "llama3:8b", ""),
    }


def test_buckets_filter_by_series_and_date(admin_client: Client) -> None:
    now = timezone.now().replace(second=0, microsecond=0)
    old = now - timedelta(days=40)
    for usage in (
        TokenUsageFactory(backend="gpu-1", model="llama3:8b"),
        TokenUsageFactory(backend="gpu-2", model="phi3"),
    ):
        UsageBucketFactory(minute=now, backend=usage.backend, model=usage.model)
        UsageBucketFactory(minute=old, backend=usage.backend, model=usage.model)

    on_gpu_2 = admin_client.get(BUCKETS, {"backend": "gpu-2"})
    old_only = admin_client.get(
        BUCKETS,
        {
            "minute__year": str(old.year),
            "minute__month": str(old.month),
            "minute__day": str(old.day),
        },
    )
    midnight = now.replace(hour=0, minute=0)
    today = admin_client.get(BUCKETS, {"minute__gte": str(midnight)})

    assert {(b.backend, b.minute) for b in listed(on_gpu_2)} == {
        ("gpu-2", now),
        ("gpu-2", old),
    }
    assert {b.minute for b in listed(old_only)} == {old}
    assert {b.minute for b in listed(today)} == {now}
    assert "llama3:8b" in on_gpu_2.content.decode()  # offered in the model filter


@pytest.mark.parametrize("url", [TOKEN_USAGE, BUCKETS])
def test_usage_changelists_query_count_does_not_grow_with_rows(
    admin_client: Client, django_assert_max_num_queries: Any, url: str
) -> None:
    keys = create_keys(5)
    for index in range(50):
        prefix = keys[index % 5].prefix
        TokenUsageFactory(api_key_prefix=prefix)
        UsageBucketFactory(api_key_prefix=prefix)

    with django_assert_max_num_queries(12):
        response = admin_client.get(url)

    assert len(listed(response)) == 50
    assert all(row.key_name for row in listed(response))


def test_usage_pages_render_with_no_rows(admin_client: Client) -> None:
    for url in (TOKEN_USAGE, BUCKETS):
        assert admin_client.get(url).status_code == 200, url
    assert TokenUsage.objects.count() == UsageBucket.objects.count() == 0
