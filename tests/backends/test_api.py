from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from backends.models import Backend, BackendModel
from routing.versioning import read_config_version
from tests.factories import (
    ApiKeyFactory,
    BackendFactory,
    BackendModelFactory,
    StaffUserFactory,
)

pytestmark = pytest.mark.django_db

SECRET = "sk-upstream-secret-7f3a9c"


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(StaffUserFactory())
    return client


def test_backend_round_trip_never_returns_the_api_key(api: APIClient) -> None:
    created = api.post(
        "/api/v1/backends",
        {
            "name": " gpu-9 ",
            "base_url": "http://10.1.2.3:11434/",
            "kind": "ollama",
            "api_key": SECRET,
            "priority": 3,
            "max_concurrency": 4,
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    body = created.json()
    # The model's clean() normalised what was sent, as in the admin.
    assert body["name"] == "gpu-9"
    assert body["base_url"] == "http://10.1.2.3:11434"
    assert body["has_api_key"] is True
    assert "api_key" not in body
    backend = Backend.objects.get(pk=body["id"])
    assert backend.api_key == SECRET

    url = f"/api/v1/backends/{backend.pk}"
    responses = [
        api.get(url),
        api.get("/api/v1/backends"),
        api.patch(url, {"priority": 1}, format="json"),
        api.put(
            url,
            {"name": "gpu-9", "base_url": "http://10.1.2.3:11434", "kind": "ollama"},
            format="json",
        ),
    ]
    for response in responses:
        assert response.status_code == 200, response.content
        assert SECRET not in response.content.decode()
        assert b'"api_key"' not in response.content
    backend.refresh_from_db()
    # Updates that leave the key out keep it.
    assert backend.api_key == SECRET
    assert backend.priority == 1

    cleared = api.patch(url, {"api_key": ""}, format="json")
    assert cleared.json()["has_api_key"] is False
    backend.refresh_from_db()
    assert backend.api_key == ""

    assert api.delete(url).status_code == 204
    assert not Backend.objects.filter(pk=backend.pk).exists()


def test_changing_health_fields_is_refused_not_ignored(api: APIClient) -> None:
    backend = BackendFactory(unhealthy=True)

    response = api.patch(
        f"/api/v1/backends/{backend.pk}",
        {"status": "draining", "consecutive_failures": 0, "priority": 1},
        format="json",
    )

    assert response.status_code == 400
    errors = response.json()
    assert errors["status"][0].startswith("This field is read-only.")
    assert "/drain" in errors["status"][0]
    assert errors["consecutive_failures"] == ["This field is read-only."]
    backend.refresh_from_db()
    assert backend.status == "unhealthy" and backend.consecutive_failures == 3
    assert backend.priority != 1  # nothing of a refused request is applied


def test_unknown_fields_are_refused(api: APIClient) -> None:
    backend = BackendFactory(priority=5)

    response = api.patch(
        f"/api/v1/backends/{backend.pk}", {"prority": 1}, format="json"
    )

    assert response.status_code == 400
    assert response.json() == {"prority": ["Unknown field."]}


@pytest.mark.parametrize("encoding", ["multipart", "form"])
def test_bodies_that_are_not_json_are_refused_with_415(
    api: APIClient, encoding: str
) -> None:
    fields = {"name": "gpu-form", "base_url": "http://10.1.2.3:8000", "kind": "vllm"}
    if encoding == "multipart":
        answer = api.post("/api/v1/backends", fields, format="multipart")
    else:
        answer = api.generic(
            "POST",
            "/api/v1/backends",
            "name=gpu-form&base_url=http%3A%2F%2F10.1.2.3%3A8000&kind=vllm",
            content_type="application/x-www-form-urlencoded",
        )
    assert answer.status_code == 415
    assert "Unsupported media type" in answer.json()["detail"]
    assert not Backend.objects.filter(name="gpu-form").exists()


def test_what_a_get_returned_can_be_put_back(api: APIClient) -> None:
    backend = BackendFactory(name="gpu-1", unhealthy=True, api_key=SECRET)
    url = f"/api/v1/backends/{backend.pk}"
    body = api.get(url).json()

    response = api.put(url, body | {"priority": 3}, format="json")

    assert response.status_code == 200, response.content
    backend.refresh_from_db()
    assert (backend.priority, backend.status, backend.api_key) == (
        3,
        "unhealthy",
        SECRET,
    )


@pytest.mark.django_db(transaction=True)
def test_drain_and_undrain_a_backend(
    api: APIClient, mock_backend_factory: Callable[..., Any]
) -> None:
    mock = mock_backend_factory("--models", "llama3:8b", "--name", "mock-drain")
    backend = BackendFactory(name="mock-drain", base_url=mock.base_url)
    version = read_config_version()

    drained = api.post(f"/api/v1/backends/{backend.pk}/drain")

    assert drained.status_code == 200, drained.content
    assert drained.json()["status"] == "draining"
    assert read_config_version() == version + 1
    again = api.post(f"/api/v1/backends/{backend.pk}/drain/")
    assert again.json()["status"] == "draining"
    assert read_config_version() == version + 1  # already draining: no change

    # Undrain probes the backend now, as the admin action does: it answers.
    undrained = api.post(f"/api/v1/backends/{backend.pk}/undrain")

    assert undrained.status_code == 200
    assert undrained.json()["status"] == "healthy"
    assert undrained.json()["last_check_at"] is not None
    backend.refresh_from_db()
    assert backend.status == "healthy"


def test_drain_of_an_unknown_backend_is_a_404(api: APIClient) -> None:
    response = api.post("/api/v1/backends/424242/drain")

    assert response.status_code == 404
    assert response.json() == {"detail": "No Backend matches the given query."}


@pytest.mark.parametrize(
    ("payload", "field", "message"),
    [
        (
            {"base_url": "ftp://files.example"},
            "base_url",
            "Use an http:// or https:// URL with a host.",
        ),
        (
            {"base_url": "http://user:pw@10.0.0.1"},
            "base_url",
            "Put credentials in the API key field, not in the URL.",
        ),
        ({"base_url": "not a url"}, "base_url", "Enter a valid URL."),
        ({"name": "taken"}, "name", "Backend with this Name already exists."),
        ({"max_concurrency": 0}, "max_concurrency", "greater than or equal to 1"),
        ({"kind": "gopher"}, "kind", '"gopher" is not a valid choice.'),
    ],
)
def test_invalid_backends_get_field_errors(
    api: APIClient, payload: dict[str, Any], field: str, message: str
) -> None:
    BackendFactory(name="taken")
    data = {"name": "new", "base_url": "http://10.0.0.7:8000", "api_key": SECRET}

    response = api.post("/api/v1/backends", data | payload, format="json")

    assert response.status_code == 400
    errors = response.json()
    assert message in " ".join(errors[field])
    assert SECRET not in response.content.decode()
    assert not Backend.objects.filter(name="new").exists()


def test_backend_list_is_filtered_paginated_and_query_bounded(
    api: APIClient, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    for n in range(12):
        backend = BackendFactory(name=f"b{n:02d}", enabled=n % 2 == 0)
        BackendModelFactory.create_batch(2, backend=backend)

    with django_assert_max_num_queries(2):
        page = api.get("/api/v1/backends", {"enabled": "true", "limit": 4})

    body = page.json()
    assert body["count"] == 6
    assert [b["name"] for b in body["results"]] == ["b00", "b02", "b04", "b06"]
    assert body["results"][0]["model_count"] == 2
    assert body["next"] is not None


def test_backend_model_round_trip_and_filter_by_backend(api: APIClient) -> None:
    gpu = BackendFactory(name="gpu-1")
    other = BackendFactory(name="gpu-2")
    BackendModelFactory(backend=other, name="mistral:7b")

    created = api.post(
        "/api/v1/backend-models",
        {
            "backend": gpu.pk,
            "name": " llava:7b ",
            "context_length": 4096,
            "supports_vision": True,
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert (body["name"], body["backend_name"]) == ("llava:7b", "gpu-1")
    assert body["discovered"] is False

    listed = api.get("/api/v1/backend-models", {"backend": gpu.pk}).json()
    assert [m["name"] for m in listed["results"]] == ["llava:7b"]
    by_name = api.get("/api/v1/backend-models", {"backend_name": "gpu-2"}).json()
    assert [m["name"] for m in by_name["results"]] == ["mistral:7b"]

    url = f"/api/v1/backend-models/{body['id']}"
    patched = api.patch(url, {"supports_tools": True}, format="json")
    assert patched.json()["supports_tools"] is True
    assert api.delete(url).status_code == 204
    assert not BackendModel.objects.filter(pk=body["id"]).exists()


def test_backend_model_rules_match_the_admin(api: APIClient) -> None:
    existing = BackendModelFactory(name="llama3:8b")

    duplicate = api.post(
        "/api/v1/backend-models",
        {"backend": existing.backend_id, "name": "llama3:8b"},
        format="json",
    )
    blank = api.post(
        "/api/v1/backend-models",
        {"backend": existing.backend_id, "name": "   "},
        format="json",
    )
    no_backend = api.post(
        "/api/v1/backend-models", {"backend": 999999, "name": "x"}, format="json"
    )

    assert duplicate.status_code == 400
    assert duplicate.json() == {
        "non_field_errors": ["Backend model with this Backend and Name already exists."]
    }
    assert blank.status_code == 400 and "name" in blank.json()
    assert no_backend.status_code == 400 and "backend" in no_backend.json()


def test_backend_model_list_is_query_bounded(
    api: APIClient, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    for backend in BackendFactory.create_batch(5):
        BackendModelFactory.create_batch(4, backend=backend)

    with django_assert_max_num_queries(2):
        response = api.get("/api/v1/backend-models")

    assert response.json()["count"] == 20


@pytest.mark.parametrize("path", ["/api/v1/backends", "/api/v1/backend-models"])
def test_only_staff_may_use_the_backend_api(path: str) -> None:
    BackendFactory(api_key=SECRET)
    anonymous = APIClient()
    assert anonymous.get(path).status_code in (401, 403)
    assert anonymous.post(path, {}, format="json").status_code in (401, 403)

    member = APIClient()
    member.force_authenticate(StaffUserFactory(is_staff=False))
    assert member.get(path).status_code == 403

    ApiKeyFactory(raw_key="nx-client00-secret")
    client_key = APIClient(HTTP_AUTHORIZATION="Bearer nx-client00-secret")
    response = client_key.get(path)
    assert response.status_code in (401, 403)
    assert SECRET not in response.content.decode()


def test_an_admin_token_may_use_the_backend_api() -> None:
    token = Token.objects.create(user=StaffUserFactory())
    client = APIClient(HTTP_AUTHORIZATION=f"Token {token.key}")

    response = client.post(
        "/api/v1/backends",
        {"name": "scripted", "base_url": "https://api.example.com"},
        format="json",
    )

    assert response.status_code == 201


@pytest.mark.django_db(transaction=True)
def test_every_committed_backend_change_bumps_the_config_version(
    api: APIClient,
) -> None:
    versions = [read_config_version()]

    def step(response: Any, status: int) -> None:
        assert response.status_code == status, response.content
        versions.append(read_config_version())

    step(
        api.post(
            "/api/v1/backends",
            {"name": "gpu-1", "base_url": "http://10.0.0.1:8000"},
            format="json",
        ),
        201,
    )
    backend_id = Backend.objects.get(name="gpu-1").pk
    step(
        api.patch(f"/api/v1/backends/{backend_id}", {"priority": 2}, format="json"), 200
    )
    step(
        api.post(
            "/api/v1/backend-models",
            {"backend": backend_id, "name": "llama3:8b"},
            format="json",
        ),
        201,
    )
    model_id = BackendModel.objects.get().pk
    step(
        api.patch(
            f"/api/v1/backend-models/{model_id}", {"loaded": True}, format="json"
        ),
        200,
    )
    step(api.delete(f"/api/v1/backend-models/{model_id}"), 204)
    step(api.delete(f"/api/v1/backends/{backend_id}"), 204)
    # A refused change commits nothing and bumps nothing.
    step(api.post("/api/v1/backends", {"name": ""}, format="json"), 400)

    assert versions == [versions[0] + n for n in (0, 1, 2, 3, 4, 5, 6, 6)]


def test_capabilities_an_operator_edits_are_kept_from_discovery(api: APIClient) -> None:
    found = BackendModelFactory(
        discovered=True, supports_tools=False, supports_vision=False
    )

    response = api.patch(
        f"/api/v1/backend-models/{found.pk}",
        {"supports_tools": True, "supports_vision": False, "loaded": True},
        format="json",
    )

    assert response.status_code == 200
    # supports_vision was sent unchanged and loaded is not the operator's to claim.
    assert response.json()["manual_fields"] == ["supports_tools"]
    found.refresh_from_db()
    assert found.manual_fields == ["supports_tools"]
