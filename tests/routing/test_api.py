from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from tests.factories import ApiKeyFactory, BackendFactory, BackendModelFactory

pytestmark = pytest.mark.django_db

URL = "/api/v1/route/explain"
VISION_CHAT = {
    "model": "llava:7b",
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
            ],
        }
    ],
}


@pytest.fixture
def staff_client() -> APIClient:
    user = get_user_model().objects.create_user("ops", is_staff=True, is_superuser=True)
    client = APIClient()
    client.force_authenticate(user)
    return client


def test_explain_returns_the_decision_record(staff_client: APIClient) -> None:
    seeing = BackendFactory(name="gpu-vision", priority=5)
    BackendModelFactory(backend=seeing, name="llava:7b", supports_vision=True)
    blind = BackendFactory(name="gpu-blind", priority=1)
    BackendModelFactory(backend=blind, name="llava:7b", supports_vision=False)

    response = staff_client.post(URL, VISION_CHAT, format="json")

    assert response.status_code == 200
    record = response.json()
    assert record["requirements"]["needs_vision"] is True
    assert record["chosen"] == {"backend": "gpu-vision", "model": "llava:7b"}
    assert record["excluded"][0]["backend"] == "gpu-blind"
    assert "no_vision" in record["excluded"][0]["reasons"]
    assert record["candidates"][0]["score"]["total"] > 0
    assert record["weights"] == {"priority": 50, "load": 30, "latency": 20}


def test_explain_reports_the_error_a_client_would_get(staff_client: APIClient) -> None:
    response = staff_client.post(URL, {"model": "gpt-5"}, format="json")
    assert response.status_code == 200
    assert response.json()["error"]["status"] == 404
    assert response.json()["error"]["message"] == "Model 'gpt-5' not found"


@pytest.mark.parametrize(
    "body", [[1, 2], {"messages": []}, {"model": ""}, {"model": 7}]
)
def test_bad_bodies_get_an_openai_shaped_400(staff_client: APIClient, body) -> None:
    response = staff_client.post(URL, body, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"


def test_admin_token_authenticates() -> None:
    user = get_user_model().objects.create_user(
        "robot", is_staff=True, is_superuser=True
    )
    token = Token.objects.create(user=user)
    client = APIClient()
    response = client.post(
        URL, {"model": "x"}, format="json", HTTP_AUTHORIZATION=f"Token {token.key}"
    )
    assert response.status_code == 200


def test_anonymous_non_staff_and_client_keys_are_refused() -> None:
    client = APIClient()
    assert client.post(URL, {"model": "x"}, format="json").status_code in (401, 403)

    user = get_user_model().objects.create_user("dev", password="pw-long-enough-1")
    client.force_authenticate(user)
    assert client.post(URL, {"model": "x"}, format="json").status_code == 403

    key = ApiKeyFactory(raw_key="nx-client-key-0000000000000000")
    anonymous = APIClient()
    response = anonymous.post(
        URL,
        {"model": "x"},
        format="json",
        HTTP_AUTHORIZATION="Bearer nx-client-key-0000000000000000",
    )
    assert key.pk and response.status_code in (401, 403)
