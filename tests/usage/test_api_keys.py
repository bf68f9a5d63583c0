"""Client API keys over the management API: create (secret once), list, revoke."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import openai
import pytest
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import MockBackendProcess, NexusServer
from tests.factories import ApiKeyFactory, StaffUserFactory
from usage.models import ApiKey, KeySpend

MODEL = "llama3:8b"


@pytest.fixture
def api() -> APIClient:
    token = Token.objects.create(user=StaffUserFactory())
    return APIClient(HTTP_AUTHORIZATION=f"Token {token.key}")


@pytest.mark.django_db
def test_a_new_key_shows_its_secret_once(api: APIClient) -> None:
    created = api.post("/api/v1/keys", {"name": " ci-runner "}, format="json")

    assert created.status_code == 201, created.content
    key = created.json()
    assert key["name"] == "ci-runner"
    assert key["key"].startswith("nx-") and key["key"].startswith(key["prefix"])
    assert key["is_active"] is True
    stored = ApiKey.objects.get()
    assert stored.matches(key["key"]) and key["key"] not in stored.hashed_key

    listed = api.get("/api/v1/keys").json()
    shown = api.get(f"/api/v1/keys/{key['id']}").json()
    assert listed["count"] == 1
    for answer in (listed["results"][0], shown):
        assert "key" not in answer and "hashed_key" not in answer
        assert answer["prefix"] == key["prefix"]
    assert key["key"] not in str(listed) + str(shown)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("payload", "field", "message"),
    [
        ({}, "name", "This field is required."),
        ({"name": ""}, "name", "may not be blank"),
        ({"name": "x" * 101}, "name", "no more than 100 characters"),
        ({"name": "a", "is_active": False}, "is_active", "read-only"),
        ({"name": "a", "prefix": "nx-chosen"}, "prefix", "read-only"),
    ],
)
def test_bad_key_requests_get_field_errors(
    api: APIClient, payload: dict[str, object], field: str, message: str
) -> None:
    response = api.post("/api/v1/keys", payload, format="json")

    assert response.status_code == 400
    assert message in " ".join(response.json()[field])
    assert not ApiKey.objects.exists()


@pytest.mark.django_db
def test_a_key_can_be_renamed_but_not_reactivated(api: APIClient) -> None:
    key = ApiKeyFactory(name="old", is_active=False)
    url = f"/api/v1/keys/{key.pk}"

    assert api.patch(url, {"name": "new"}, format="json").json()["name"] == "new"
    refused = api.patch(url, {"is_active": True}, format="json")

    assert refused.status_code == 400
    assert "/revoke" in refused.json()["is_active"][0]
    key.refresh_from_db()
    assert (key.name, key.is_active) == ("new", False)
    assert api.delete(url).status_code == 405  # revoke; usage keeps the name


@pytest.mark.django_db
def test_the_key_list_is_filtered_and_query_bounded(
    api: APIClient, django_assert_max_num_queries: Callable[..., object]
) -> None:
    ApiKeyFactory.create_batch(5)
    ApiKeyFactory(name="revoked", is_active=False)

    with django_assert_max_num_queries(4):  # token, user, count, page
        answer = api.get("/api/v1/keys", {"is_active": "false"}).json()

    assert [key["name"] for key in answer["results"]] == ["revoked"]


@pytest.mark.django_db(transaction=True)
def test_a_key_made_over_the_api_works_until_it_is_revoked(
    api: APIClient,
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    mock = mock_backend_factory("--models", MODEL, "--name", "mock-keys")
    backend = Backend.objects.create(
        name="mock-keys", base_url=mock.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name=MODEL)
    server = nexus_server_factory()
    created = api.post("/api/v1/keys", {"name": "sdk"}, format="json").json()
    sdk = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=created["key"], max_retries=0
    )

    def chat() -> None:
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )

    _eventually(chat, accepts=(openai.AuthenticationError,))  # key reaches it
    revoked = api.post(f"/api/v1/keys/{created['id']}/revoke")
    assert revoked.status_code == 200
    assert revoked.json()["is_active"] is False

    def refused() -> None:
        with pytest.raises(openai.AuthenticationError):
            chat()

    _eventually(refused, accepts=(AssertionError, pytest.fail.Exception))


def _eventually(
    check: Callable[[], None],
    accepts: tuple[type[BaseException], ...],
    timeout: float = 15.0,
) -> None:
    """Run `check` until it passes; the errors in `accepts` mean "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except accepts:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.django_db
def test_a_key_is_created_and_changed_with_its_limits_and_budgets(
    api: APIClient,
) -> None:
    created = api.post(
        "/api/v1/keys",
        {
            "name": "team-a",
            "allowed_models": "llama3:*, gpt-4",
            "expires_at": "2030-01-01T00:00:00Z",
            "rpm_limit": 60,
            "tpm_limit": 10_000,
            "max_concurrency": 4,
            "budget_period": "day",
            "budget_tokens": 1_000_000,
            "budget_usd": "12.5",
            "admission_weight": 2,
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    key = created.json()
    assert key["allowed_models"] == "llama3:*,gpt-4"
    assert (key["rpm_limit"], key["tpm_limit"], key["max_concurrency"]) == (
        60,
        10_000,
        4,
    )
    assert (key["budget_period"], key["budget_tokens"], key["budget_usd"]) == (
        "day",
        1_000_000,
        "12.5000",
    )
    stored = ApiKey.objects.get()
    assert stored.budget_nanos == 12_500_000_000 and stored.admission_weight == 2

    changed = api.patch(
        f"/api/v1/keys/{key['id']}",
        {"rpm_limit": None, "budget_usd": None, "allowed_models": ""},
        format="json",
    )
    assert changed.status_code == 200, changed.content
    stored.refresh_from_db()
    assert (stored.rpm_limit, stored.budget_usd, stored.allowed_models) == (
        None,
        None,
        "",
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"rpm_limit": 0}, "rpm_limit"),
        ({"tpm_limit": -5}, "tpm_limit"),
        ({"budget_usd": "0"}, "budget_usd"),
        ({"budget_period": "week"}, "budget_period"),
        ({"allowed_models": "llama3 8b"}, "allowed_models"),
        ({"expires_at": "soon"}, "expires_at"),
    ],
)
def test_bad_limits_get_field_errors(
    api: APIClient, payload: dict[str, object], field: str
) -> None:
    answer = api.post("/api/v1/keys", {"name": "x", **payload}, format="json")
    assert answer.status_code == 400
    assert set(answer.json()) == {field}


@pytest.mark.django_db
def test_a_keys_usage_shows_spend_this_period_against_its_budgets(
    api: APIClient,
) -> None:
    key, _ = ApiKey.objects.create_key(
        "spender", budget_period="day", budget_tokens=1000, budget_usd="0.01"
    )
    today = timezone.now().date()
    KeySpend.objects.create(
        api_key_prefix=key.prefix,
        day=today,
        requests=3,
        total_tokens=400,
        cost_nanos=2_500_000,
    )
    KeySpend.objects.create(
        api_key_prefix=key.prefix,
        day=today - timedelta(days=3),
        requests=1,
        total_tokens=50,
        cost_nanos=1_000,
    )

    answer = api.get(f"/api/v1/keys/{key.pk}/usage")

    assert answer.status_code == 200, answer.content
    usage = answer.json()
    assert usage["period"] == {
        "period": f"d{today:%Y%m%d}",
        "requests": 3,
        "total_tokens": 400,
        "cost_usd": "0.002500000",
        "remaining_tokens": 600,
        "remaining_usd": "0.007500000",
    }
    assert usage["all_time"] == {
        "requests": 4,
        "total_tokens": 450,
        "cost_usd": "0.002501000",
    }


@pytest.mark.django_db
def test_model_prices_are_managed_over_the_api(api: APIClient) -> None:
    created = api.post(
        "/api/v1/prices",
        {"model": "llama3:*", "input_per_million": "0.2", "output_per_million": "0.6"},
        format="json",
    )
    assert created.status_code == 201, created.content
    price = created.json()
    assert (price["input_per_million"], price["output_per_million"]) == (
        "0.200",
        "0.600",
    )
    for body, field in (
        ({"model": "bad name"}, "model"),
        ({"model": "x", "input_per_million": "-1"}, "input_per_million"),
        ({"model": "llama3:*"}, "model"),  # taken
    ):
        refused = api.post("/api/v1/prices", body, format="json")
        assert refused.status_code == 400
        assert set(refused.json()) == {field}
    assert api.delete(f"/api/v1/prices/{price['id']}").status_code == 204
