"""Client API keys: only a hash is stored, and only active keys resolve."""

from __future__ import annotations

import hashlib

import pytest
from django.db import IntegrityError, transaction

from tests.factories import ApiKeyFactory, TokenUsageFactory
from usage.models import ApiKey, TokenUsage, hash_key


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
