"""The management API as a script meets it: URLs, the index, auth and errors."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from routing.api import views as routing_api_views
from tests.factories import AliasFactory, BackendFactory, StaffUserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def token_client() -> APIClient:
    token = Token.objects.create(user=StaffUserFactory())
    return APIClient(HTTP_AUTHORIZATION=f"Token {token.key}")


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/backends",
        "/api/v1/backends/",
        "/api/v1/aliases/",
        "/api/v1/policy/",
        "/api/v1/config/",
        "/api/v1/usage/stats/",
        "/api/v1/schema",
        "/api/v1/schema/",
    ],
)
def test_paths_work_with_and_without_a_trailing_slash(
    token_client: APIClient, path: str
) -> None:
    BackendFactory(name="gpu-1")

    response = token_client.get(path, HTTP_ACCEPT="application/json")

    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith(
        ("application/json", "application/vnd.oai.openapi+json")
    )


def test_a_post_with_a_trailing_slash_creates_without_a_redirect(
    token_client: APIClient,
) -> None:
    response = token_client.post(
        "/api/v1/aliases/", {"name": "gpt-4", "target": "llama3:8b"}, format="json"
    )

    assert response.status_code == 201, response.content
    detail = token_client.get(f"/api/v1/aliases/{response.json()['id']}/")
    assert detail.json()["target"] == "llama3:8b"


def test_the_index_lists_every_endpoint(token_client: APIClient) -> None:
    AliasFactory()

    index = token_client.get("/api/v1/").json()

    assert index["backends"] == "http://testserver/api/v1/backends"
    assert index["schema"] == "http://testserver/api/v1/schema/"
    for name, url in index.items():
        if name in ("route_explain", "config_import", "cache_purge", "docs"):
            continue  # POST only; a page for a browser with a staff session
        response = token_client.get(url, HTTP_ACCEPT="application/json")
        assert response.status_code == 200, (name, response.content)


@pytest.mark.parametrize(
    "path", ["/api/v1/", "/api/v1/backends", "/api/v1/keys", "/api/v1/config/export"]
)
def test_no_credentials_get_401_with_the_scheme_to_use(path: str) -> None:
    response = APIClient().get(path)

    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"
    assert "credentials were not provided" in response.json()["detail"]


@pytest.mark.parametrize(
    "path", ["/api/v1/nothing-here", "/api/v1/backends/99999/nope", "/api/v2/"]
)
def test_unknown_api_paths_get_a_json_404(token_client: APIClient, path: str) -> None:
    response = token_client.get(path)

    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert "GET /api/v1/ lists them" in response.json()["detail"]


def test_unknown_pages_outside_the_api_stay_html(client: Client) -> None:
    response = client.get("/no-such-page")

    assert response.status_code == 404
    assert "text/html" in response["Content-Type"]


def test_a_wrong_method_gets_a_json_405(token_client: APIClient) -> None:
    response = token_client.delete("/api/v1/policy")

    assert response.status_code == 405
    assert response.json() == {"detail": 'Method "DELETE" not allowed.'}


def test_a_crash_under_the_api_is_a_json_500(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the database caught fire")

    monkeypatch.setattr(routing_api_views, "build_snapshot", crash)
    token = Token.objects.create(user=StaffUserFactory())
    client = Client(
        raise_request_exception=False, HTTP_AUTHORIZATION=f"Token {token.key}"
    )

    response = client.get("/api/v1/config")

    assert response.status_code == 500
    assert response["Content-Type"] == "application/json"
    assert response.json() == {
        "detail": "Internal server error; the server's log has the details."
    }
    assert "fire" not in response.content.decode()


DEEP_JSON = "[" * 10_000 + "]" * 10_000


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/api/v1/backends"),
        ("post", "/api/v1/aliases"),
        ("post", "/api/v1/fallback-chains"),
        ("patch", "/api/v1/policy"),
        ("post", "/api/v1/keys"),
        ("post", "/api/v1/workers"),
        ("post", "/api/v1/prices"),
        ("post", "/api/v1/route/explain"),
        ("post", "/api/v1/config/import"),
    ],
)
def test_json_nested_ten_thousand_deep_is_a_400_not_a_500(
    token_client: APIClient, method: str, path: str
) -> None:
    response = getattr(token_client, method)(
        path, DEEP_JSON, content_type="application/json"
    )

    assert response.status_code == 400, response.content
    assert "nested too deeply" in response.json()["detail"]


def test_toml_nested_ten_thousand_deep_is_a_400_not_a_500(
    token_client: APIClient,
) -> None:
    toml = "[routing]\nstrategy = " + "[" * 10_000 + "]" * 10_000 + "\n"
    response = token_client.post(
        "/api/v1/config/import?dry_run=1", toml, content_type="application/toml"
    )

    assert response.status_code == 400, response.content
    assert "nested too deeply" in str(response.json())
