from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.staticfiles import finders
from django.test import override_settings
from rest_framework.test import APIClient

from routing.core import FLEET_SETTINGS, STRATEGY_ENV
from routing.models import Alias, FallbackChain, RoutingPolicy
from routing.versioning import read_config_version
from tests.factories import (
    AliasFactory,
    ApiKeyFactory,
    BackendFactory,
    BackendModelFactory,
    ChainStepFactory,
    FallbackChainFactory,
    StaffUserFactory,
    TokenUsageFactory,
)

SECRET = "sk-upstream-secret-c0ffee"


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(StaffUserFactory())
    return client


# --- Aliases -------------------------------------------------------------------


@pytest.mark.django_db
def test_alias_round_trip(api: APIClient) -> None:
    created = api.post(
        "/api/v1/aliases", {"name": " gpt-4 ", "target": "llama3:70b"}, format="json"
    )
    assert created.status_code == 201, created.content
    alias = created.json()
    assert (alias["name"], alias["target"]) == ("gpt-4", "llama3:70b")

    url = f"/api/v1/aliases/{alias['id']}"
    assert api.get(url).json()["target"] == "llama3:70b"
    assert api.patch(url, {"target": "llama3:8b"}, format="json").status_code == 200
    assert Alias.objects.get().target == "llama3:8b"
    assert api.get("/api/v1/aliases", {"name": "gpt-4"}).json()["count"] == 1
    assert api.delete(url).status_code == 204
    assert not Alias.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("payload", "field", "message"),
    [
        (
            {"name": "gpt-4o", "target": "gpt-4"},
            "target",
            "'gpt-4' is itself an alias; aliases are single-level",
        ),
        (
            {"name": "llama3:70b", "target": "other"},
            "name",
            "Alias 'gpt-4' already targets 'llama3:70b'",
        ),
        ({"name": "gpt-4", "target": "x"}, "name", "already exists"),
        ({"name": "same", "target": "same"}, "target", "cannot target itself"),
        ({"name": "", "target": "x"}, "name", "may not be blank"),
    ],
)
def test_alias_rules_match_the_admin(
    api: APIClient, payload: dict[str, str], field: str, message: str
) -> None:
    AliasFactory(name="gpt-4", target="llama3:70b")

    response = api.post("/api/v1/aliases", payload, format="json")

    assert response.status_code == 400
    assert message in " ".join(response.json()[field])
    assert Alias.objects.count() == 1


# --- Fallback chains -----------------------------------------------------------


@pytest.mark.django_db
def test_fallback_chain_round_trip_keeps_the_order(api: APIClient) -> None:
    created = api.post(
        "/api/v1/fallback-chains",
        {"model": "gpt-4", "fallbacks": ["llama3:70b", " mixtral ", "llama3:8b"]},
        format="json",
    )
    assert created.status_code == 201, created.content
    chain = created.json()
    assert chain["fallbacks"] == ["llama3:70b", "mixtral", "llama3:8b"]

    url = f"/api/v1/fallback-chains/{chain['id']}"
    reordered = api.patch(
        url, {"fallbacks": ["llama3:8b", "llama3:70b"]}, format="json"
    )
    assert reordered.status_code == 200, reordered.content
    assert reordered.json()["fallbacks"] == ["llama3:8b", "llama3:70b"]
    assert api.get(url).json()["fallbacks"] == ["llama3:8b", "llama3:70b"]
    assert FallbackChain.objects.get().fallback_models == ["llama3:8b", "llama3:70b"]

    renamed = api.patch(url, {"model": "gpt-4o"}, format="json")
    assert renamed.json() | {"updated_at": None} == {
        **chain,
        "model": "gpt-4o",
        "fallbacks": ["llama3:8b", "llama3:70b"],
        "updated_at": None,
    }
    assert api.delete(url).status_code == 204
    assert not FallbackChain.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("payload", "errors"),
    [
        (
            {"model": "gpt-4", "fallbacks": ["a", "gpt-4"]},
            {"fallbacks": {"1": ["'gpt-4' cannot be a fallback for itself."]}},
        ),
        (
            {"model": "gpt-4", "fallbacks": ["a", "b", "a"]},
            {"fallbacks": {"2": ["'a' is listed more than once."]}},
        ),
        (
            {"model": "taken", "fallbacks": []},
            {"model": ["Fallback chain with this Model already exists."]},
        ),
        ({"model": "gpt-4", "fallbacks": "a,b"}, {"fallbacks": None}),
    ],
)
def test_fallback_chain_rules_match_the_admin(
    api: APIClient, payload: dict[str, Any], errors: dict[str, Any]
) -> None:
    ChainStepFactory(chain=FallbackChainFactory(model="taken"), model="x")

    response = api.post("/api/v1/fallback-chains", payload, format="json")

    assert response.status_code == 400
    body = response.json()
    for field, expected in errors.items():
        assert field in body
        if expected is not None:
            assert body[field] == expected
    assert FallbackChain.objects.count() == 1


@pytest.mark.django_db
def test_fallback_chain_list_is_query_bounded(
    api: APIClient, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    for chain in FallbackChainFactory.create_batch(8):
        ChainStepFactory.create_batch(3, chain=chain)

    with django_assert_max_num_queries(3):
        response = api.get("/api/v1/fallback-chains")

    assert [len(c["fallbacks"]) for c in response.json()["results"]] == [3] * 8


@pytest.mark.django_db
def test_alias_list_is_query_bounded(
    api: APIClient, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    AliasFactory.create_batch(15)

    with django_assert_max_num_queries(2):
        assert api.get("/api/v1/aliases").json()["count"] == 15


# --- Routing policy ------------------------------------------------------------


@pytest.mark.django_db
def test_policy_reads_defaults_until_saved_without_creating_it(api: APIClient) -> None:
    response = api.get("/api/v1/policy")

    assert response.status_code == 200
    assert response.json() | {"updated_at": None} == {
        "strategy": "smart",
        "weight_priority": 50,
        "weight_load": 30,
        "weight_latency": 20,
        "max_retries": 2,
        "admission": {
            "enabled": True,
            "flow_key": "key",
            "sizing": "tokens",
            "default_output_tokens": 256,
            "model_output_tokens": {},
            "watermark_per_backend": 4.0,
            "percentage_deviation_for_bounds": 0.1,
            "lower_bound_per_backend": None,
            "upper_bound_per_backend": None,
            "total_capacity": 1000,
            "flow_capacity": 100,
            "critical_reserved": 100,
            "queue_ttl": 30.0,
            "model_weights": {},
            "critical_share": 70,
            "default_share": 25,
            "sheddable_share": 5,
            "stock_unit": "requests",
            "watermark_tokens_per_backend": None,
        },
        **{setting.name: setting.default for setting in FLEET_SETTINGS},
        "context_shift_enabled": True,
        "context_shift_keep_last_messages": 1,
        "context_shift_max_retries": 2,
        "ensemble_opinions": 3,
        "ensemble_critique_prompt": "",
        "ensemble_refine_prompt": "",
        "ensemble_step_timeout_seconds": 120.0,
        "cache_anthropic_auto_breakpoints": False,
        "prefix_enabled": False,
        "prefix_block_chars": 256,
        "prefix_max_imbalance": 4,
        "prefix_max_imbalance_ratio": 0.5,
        "prefix_cache_blocks": 4096,
        "prefix_session_keys": "x-session-id,user,metadata.user_id",
        "prefix_session_ttl_seconds": 600.0,
        "cache_enabled": False,
        "cache_ttl_seconds": 3600,
        "cache_scope": "key",
        "cache_max_entry_bytes": 1048576,
        "cache_only_deterministic": True,
        "updated_at": None,
    }
    assert not RoutingPolicy.objects.exists()


@pytest.mark.django_db
def test_policy_put_and_patch(api: APIClient) -> None:
    put = api.put(
        "/api/v1/policy",
        {
            "strategy": "round_robin",
            "weight_priority": 40,
            "weight_load": 40,
            "weight_latency": 20,
            "max_retries": 1,
        },
        format="json",
    )
    assert put.status_code == 200, put.content
    patched = api.patch("/api/v1/policy", {"max_retries": 5}, format="json")
    assert patched.status_code == 200

    policy = RoutingPolicy.objects.get()
    assert (policy.strategy, policy.weight_load, policy.max_retries) == (
        "round_robin",
        40,
        5,
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("payload", "field", "message"),
    [
        (
            {"weight_priority": 50, "weight_load": 30, "weight_latency": 10},
            "non_field_errors",
            "must sum to 100 (they sum to 90)",
        ),
        ({"max_retries": 11}, "max_retries", "less than or equal to 10"),
        ({"strategy": "fastest"}, "strategy", '"fastest" is not a valid choice.'),
        ({"weight_load": -1}, "weight_load", "greater than or equal to 0"),
    ],
)
def test_policy_rules_match_the_admin(
    api: APIClient, payload: dict[str, Any], field: str, message: str
) -> None:
    response = api.patch("/api/v1/policy", payload, format="json")

    assert response.status_code == 400
    assert message in " ".join(response.json()[field])
    assert not RoutingPolicy.objects.exists()


@pytest.mark.django_db
def test_policy_admission_settings_round_trip(api: APIClient) -> None:
    admission = {
        "flow_key": "key+model",
        "lower_bound_per_backend": 3.0,
        "upper_bound_per_backend": 6.0,
        "model_output_tokens": {"llama3:70b": 1024},
        "model_weights": {"llama3:70b": 2},
    }
    response = api.patch("/api/v1/policy", {"admission": admission}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["admission"]["model_output_tokens"] == {"llama3:70b": 1024}
    # A later PATCH of one setting leaves the others as they are.
    response = api.patch(
        "/api/v1/policy", {"admission": {"queue_ttl": 5}}, format="json"
    )
    assert response.status_code == 200, response.content
    settings = RoutingPolicy.objects.get().admission_settings()
    assert (settings.flow_key, settings.queue_ttl) == ("key+model", 5.0)
    assert (settings.lower_per_backend, settings.upper_per_backend) == (3.0, 6.0)
    assert settings.output_tokens_of("llama3:70b") == 1024
    assert settings.weight_of("llama3:70b") == 2.0


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("admission", "field", "message"),
    [
        (
            {"lower_bound_per_backend": 5, "upper_bound_per_backend": 3},
            "lower_bound_per_backend",
            "lower_bound_per_backend (5) cannot be above upper_bound_per_backend (3)",
        ),
        ({"flow_key": "team"}, "flow_key", "'team' is not a valid choice."),
        ({"queue_ttl": 0}, "queue_ttl", "must be more than 0"),
        (
            {"flow_capacity": 20, "total_capacity": 10, "critical_reserved": 0},
            "flow_capacity",
            "cannot exceed total_capacity (10)",
        ),
        (
            {"model_output_tokens": {"m": -1}},
            "model_output_tokens",
            "the output tokens of 'm' must be a whole number from 0",
        ),
        ({"queue_tll": 5}, "queue_tll", "Unknown field."),
        ({"total_capacity": "lots"}, "total_capacity", "A valid integer is required."),
    ],
)
def test_policy_admission_rules_match_the_admin(
    api: APIClient, admission: dict[str, Any], field: str, message: str
) -> None:
    response = api.patch("/api/v1/policy", {"admission": admission}, format="json")

    assert response.status_code == 400
    assert message in " ".join(response.json()["admission"][field])
    assert not RoutingPolicy.objects.exists()


# --- Effective config ----------------------------------------------------------


@pytest.mark.django_db
def test_config_shows_what_the_router_uses_without_secrets(api: APIClient) -> None:
    gpu = BackendFactory(name="gpu-1", api_key=SECRET, priority=1)
    BackendModelFactory(backend=gpu, name="llama3:8b", supports_tools=True)
    BackendFactory(name="gpu-2", priority=2)
    AliasFactory(name="gpt-4", target="llama3:8b")
    ChainStepFactory(chain=FallbackChainFactory(model="gpt-4"), model="mistral:7b")
    RoutingPolicy.objects.create(strategy="priority_only", max_retries=1)
    # As NEXUS_ROUTING_STRATEGY=random and NEXUS_ROUTING_MAX_RETRIES= would.
    overrides = override_settings(
        NEXUS_ROUTING_STRATEGY="random", NEXUS_ROUTING_MAX_RETRIES=None
    )

    with overrides:
        response = api.get("/api/v1/config")

    assert response.status_code == 200
    assert SECRET not in response.content.decode()
    config = response.json()
    assert config["version"] == read_config_version()
    fleet = config["policy"].pop("fleet")
    assert config["policy"] == {
        "strategy": "random",
        "weights": {"priority": 50, "load": 30, "latency": 20},
        "max_retries": 1,
        "overrides": {STRATEGY_ENV: "random"},
    }
    # Not the fleet strategy: no hold unless one is set.
    assert fleet["hold_seconds"] == 0
    assert fleet["pre_warm_threshold"] == 3
    first = config["backends"][0]
    assert (first["name"], first["has_api_key"]) == ("gpu-1", True)
    assert "api_key" not in first
    assert first["models"][0]["name"] == "llama3:8b"
    assert first["models"][0]["supports_tools"] is True
    assert config["backends"][1]["has_api_key"] is False
    assert config["aliases"] == {"gpt-4": "llama3:8b"}
    assert config["fallbacks"] == {"gpt-4": ["mistral:7b"]}


# --- Versioning and permissions ------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_every_committed_routing_change_bumps_the_config_version(
    api: APIClient,
) -> None:
    versions = [read_config_version()]

    def step(response: Any, status: int) -> None:
        assert response.status_code == status, response.content
        versions.append(read_config_version())

    step(api.post("/api/v1/aliases", {"name": "a", "target": "b"}, format="json"), 201)
    alias = Alias.objects.get().pk
    step(api.patch(f"/api/v1/aliases/{alias}", {"target": "c"}, format="json"), 200)
    step(api.delete(f"/api/v1/aliases/{alias}"), 204)
    # A chain and its three steps are one change.
    step(
        api.post(
            "/api/v1/fallback-chains",
            {"model": "m", "fallbacks": ["x", "y", "z"]},
            format="json",
        ),
        201,
    )
    chain = FallbackChain.objects.get().pk
    step(
        api.patch(
            f"/api/v1/fallback-chains/{chain}", {"fallbacks": ["z", "x"]}, format="json"
        ),
        200,
    )
    step(api.delete(f"/api/v1/fallback-chains/{chain}"), 204)
    step(api.patch("/api/v1/policy", {"strategy": "random"}, format="json"), 200)
    step(api.patch("/api/v1/policy", {"weight_load": 99}, format="json"), 400)
    # Reads change nothing.
    step(api.get("/api/v1/config"), 200)
    step(api.get("/api/v1/policy"), 200)

    assert versions == [versions[0] + n for n in (0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7)]


ENDPOINTS = [
    ("get", "/api/v1/aliases"),
    ("post", "/api/v1/aliases"),
    ("get", "/api/v1/fallback-chains"),
    ("post", "/api/v1/fallback-chains"),
    ("get", "/api/v1/policy"),
    ("put", "/api/v1/policy"),
    ("patch", "/api/v1/policy"),
    ("get", "/api/v1/config"),
    ("get", "/api/v1/usage/tokens"),
    ("get", "/api/v1/usage/stats"),
    ("get", "/api/v1/usage/live"),
    ("get", "/api/v1/schema/"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_anonymous_users_members_and_client_keys_are_refused(
    method: str, path: str
) -> None:
    BackendFactory(api_key=SECRET)
    ApiKeyFactory(raw_key="nx-client00-secret")
    member = APIClient()
    member.force_authenticate(StaffUserFactory(is_staff=False))
    clients = {
        "anonymous": APIClient(),
        "member": member,
        "client key": APIClient(HTTP_AUTHORIZATION="Bearer nx-client00-secret"),
    }

    for who, client in clients.items():
        response = getattr(client, method)(path, {}, format="json")
        assert response.status_code in (401, 403), who
        assert SECRET not in response.content.decode()
    assert not RoutingPolicy.objects.exists()


@pytest.mark.django_db
def test_the_docs_page_sends_browsers_to_the_login_and_uses_no_cdn(
    client: Any, admin_client: Any
) -> None:
    anonymous = client.get("/api/v1/docs/")
    assert anonymous.status_code == 302
    assert anonymous["Location"].startswith("/admin/login/")

    page = admin_client.get("/api/v1/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/" in html
    assert "cdn" not in html.lower() and "https://" not in html
    # Shipped by a Python package: collectstatic (production) or WhiteNoise's
    # finders (embedded) serve it from this project.
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert finders.find(f"drf_spectacular_sidecar/swagger-ui-dist/{asset}")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/backends",
        "/api/v1/backend-models",
        "/api/v1/aliases",
        "/api/v1/fallback-chains",
        "/api/v1/policy",
        "/api/v1/config",
        "/api/v1/usage/tokens",
        "/api/v1/usage/stats",
        "/api/v1/usage/live",
    ],
)
def test_the_browsable_api_renders_for_staff(admin_client: Any, path: str) -> None:
    TokenUsageFactory()

    response = admin_client.get(path, HTTP_ACCEPT="text/html")

    assert response.status_code == 200
    assert "text/html" in response["Content-Type"]


@pytest.mark.django_db
def test_the_schema_describes_every_endpoint(admin_client: Any) -> None:
    response = admin_client.get("/api/v1/schema/", {"format": "json"})

    assert response.status_code == 200
    paths = response.json()["paths"]
    for path in (
        "/api/v1/backends",
        "/api/v1/backends/{id}",
        "/api/v1/backend-models",
        "/api/v1/aliases",
        "/api/v1/fallback-chains/{id}",
        "/api/v1/policy",
        "/api/v1/config",
        "/api/v1/usage/tokens",
        "/api/v1/usage/stats",
        "/api/v1/usage/live",
        "/api/v1/route/explain",
        "/api/v1/keys",
        "/api/v1/keys/{id}/revoke",
        "/api/v1/backends/{id}/drain",
        "/api/v1/backends/{id}/undrain",
        "/api/v1/config/import",
        "/api/v1/config/export",
    ):
        assert path in paths
    backend = response.json()["components"]["schemas"]["BackendRequest"]
    assert backend["properties"]["api_key"]["writeOnly"] is True
