"""The fleet strategy's signals from real backends to the decision, and its settings.

Health rounds and discovery run against real mock backends (Ollama's /api/ps,
/api/tags and /api/show; llama.cpp; vLLM); the snapshot built from what they
recorded is explained as the gateway would route it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from backends.discovery import discover_models
from backends.health import check_all
from backends.kinds.adapters import parse_expiry, parse_parameter_size
from backends.models import BackendModel
from routing.core import (
    FLEET_SETTINGS,
    LiveStats,
    RequestRequirements,
    Router,
)
from routing.core.decision import Decision
from routing.core.fleet import learned_concurrency
from routing.models import RoutingPolicy
from routing.snapshot import build_snapshot
from routing.versioning import read_config_version
from tests.backends.mock_fleet import KindMock, running_mocks
from tests.conftest import MockBackendProcess
from tests.factories import (
    BackendFactory,
    BackendModelFactory,
    RoutingPolicyFactory,
)
from tests.gateway.test_proxy_hot_path import make_gateway, serve
from tests.test_settings import _load_settings
from usage.models import ApiKey

MOCK_MODEL_BYTES = 4_661_224_676  # what the mock reports for every model


@pytest.fixture(scope="module")
def mocks() -> Iterator[dict[str, KindMock]]:
    specs = (
        ("ollama", "--models", "llama3:8b,llava:7b", "--loaded-models", "llama3:8b"),
        ("llamacpp", "--models", "qwen:7b"),
        ("vllm", "--models", "qwen:7b"),
    )
    with running_mocks(*specs) as started:
        yield {mock.kind: mock for mock in started}


@pytest.fixture(autouse=True)
def _fresh_mocks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "mocks" in request.fixturenames:
        for mock in request.getfixturevalue("mocks").values():
            mock.reset()


def fleet_decision(
    model: str, tokens: int = 0, stats: LiveStats | None = None
) -> Decision:
    RoutingPolicy.objects.update_or_create(
        pk=RoutingPolicy.SINGLETON_PK, defaults={"strategy": "fleet"}
    )
    requirements = RequestRequirements(model=model, estimated_tokens=tokens)
    return Router().explain(requirements, build_snapshot(), stats or LiveStats())


def fleet_signals(decision: Decision) -> dict[str, dict[str, Any]]:
    return {
        c["backend"]: c["fleet"]  # type: ignore[misc]
        for c in decision.as_dict()["candidates"]
    }


@pytest.mark.django_db
def test_an_ollama_backends_loaded_model_is_hot_and_the_others_on_disk(
    mocks: dict[str, KindMock],
) -> None:
    mocks["ollama"].register("ollama-1", memory_ceiling_gb=12.0, tier="small")
    discover_models()
    check_all()

    llama = BackendModel.objects.get(name="llama3:8b")
    assert (llama.loaded, llama.size_bytes, llama.parameters_b) == (
        True,
        MOCK_MODEL_BYTES,
        8.0,
    )
    assert (llama.vram_bytes, llama.loaded_context_length) == (MOCK_MODEL_BYTES, 8192)
    assert llama.expires_at is not None and llama.expires_at > datetime.now(UTC)

    hot = fleet_signals(fleet_decision("llama3:8b"))["ollama-1"]
    cold = fleet_signals(fleet_decision("llava:7b"))["ollama-1"]

    assert hot["thermal"] == {"value": "hot", "points": 50}
    assert hot["role_affinity"]["points"] == 15  # an 8B model on a small machine
    assert hot["context_fit"]["value"] == {"window": 8192, "tokens": 0}
    assert cold["thermal"] == {"value": "on_disk", "points": 10}
    # 12 GB ceiling, one 4.66 GB model loaded: (12 - 4.66) / 4.66 = 1.57.
    assert cold["memory_fit"] == {
        "value": 1.57,
        "points": 15,
        "limit_gb": 12.0,
        "source": "ceiling",
    }


@pytest.mark.django_db
def test_a_model_the_backend_unloads_turns_warm_and_the_loaded_one_hot(
    mocks: dict[str, KindMock],
) -> None:
    mock = mocks["ollama"]
    mock.register("ollama-1", status="healthy")
    discover_models()
    check_all()

    mock.configure(loaded_models=["llava:7b"])
    check_all()

    assert fleet_signals(fleet_decision("llama3:8b"))["ollama-1"]["thermal"] == {
        "value": "warm",
        "points": 30,
    }
    assert fleet_signals(fleet_decision("llava:7b"))["ollama-1"]["thermal"] == {
        "value": "hot",
        "points": 50,
    }


@pytest.mark.django_db
def test_a_cold_model_that_does_not_fit_is_not_routed_there(
    mocks: dict[str, KindMock],
) -> None:
    # Room for the loaded model and not much more; it is answering a request.
    mocks["ollama"].register("ollama-1", memory_ceiling_gb=6.0)
    discover_models()
    check_all()
    busy = LiveStats()
    busy.add_waiting("ollama-1", "llama3:8b")

    decision = fleet_decision("llava:7b", stats=busy)

    assert decision.error is not None and decision.error.status == 503
    [excluded] = decision.excluded
    assert [str(r) for r in excluded.reasons] == ["no_memory"]
    # The loaded model itself still goes there.
    assert fleet_decision("llama3:8b", stats=busy).chosen is not None
    # Idle, it is what Ollama unloads to load the other: no fit points, routed.
    idle = fleet_decision("llava:7b")
    assert idle.chosen is not None
    assert fleet_signals(idle)["ollama-1"]["memory_fit"]["points"] == 0


@pytest.mark.django_db(transaction=True)
def test_a_refreshed_keep_alive_does_not_bump_the_version_but_unloading_does() -> None:
    with running_mocks(("ollama", "--models", "a,b", "--loaded-models", "a")) as (
        mock,
    ):
        backend = mock.register("ollama-1", status="healthy")
        BackendModelFactory(backend=backend, name="a", discovered=True)
        BackendModelFactory(backend=backend, name="b", discovered=True)
        check_all()
        before = read_config_version()

        check_all()  # the same models loaded; keep_alive a moment later
        unchanged = read_config_version()
        mock.configure(loaded_models=["b"])
        check_all()

    assert unchanged == before
    assert read_config_version() > before
    assert BackendModel.objects.get(name="a").last_loaded_at is not None


@pytest.mark.django_db
def test_llamacpp_and_vllm_models_are_always_hot(mocks: dict[str, KindMock]) -> None:
    mocks["llamacpp"].register("llamacpp-1")
    mocks["vllm"].register("vllm-1")
    discover_models()
    check_all()

    found = fleet_signals(fleet_decision("qwen:7b"))

    assert {name: s["thermal"]["value"] for name, s in found.items()} == {
        "llamacpp-1": "hot",
        "vllm-1": "hot",
    }


@pytest.mark.django_db
def test_llamacpp_slots_and_vllm_pressure_reach_the_snapshot_and_the_admin(
    mocks: dict[str, KindMock], admin_client: Client
) -> None:
    mocks["llamacpp"].register("llamacpp-1")
    mocks["vllm"].register("vllm-1")
    mocks["llamacpp"].configure(slots=3)
    mocks["vllm"].configure(kv_cache_usage=0.98)
    discover_models()
    check_all()

    routes = build_snapshot()
    llamacpp, vllm = routes.backend("llamacpp-1"), routes.backend("vllm-1")
    assert llamacpp is not None and vllm is not None
    assert (llamacpp.slots, llamacpp.memory_pressure) == (3, False)
    assert (vllm.slots, vllm.memory_pressure) == (None, True)
    model = llamacpp.models_by_name["qwen:7b"]
    stats = LiveStats()
    policy = routes.policy.fleet
    assert learned_concurrency(llamacpp, model, stats, policy, 0.0) == 3
    listing = admin_client.get(reverse("admin:backends_backend_changelist"))
    assert listing.content.decode().count(">cold loads paused</small>") == 1

    mocks["vllm"].configure(kv_cache_usage=0.2)
    check_all()
    relieved = build_snapshot().backend("vllm-1")
    assert relieved is not None and not relieved.memory_pressure


@pytest.mark.django_db
def test_nexus_route_explain_shows_the_signals(mocks: dict[str, KindMock]) -> None:
    mocks["ollama"].register("ollama-1", tier="large")
    discover_models()
    check_all()
    RoutingPolicyFactory(strategy="fleet")
    out = StringIO()

    call_command("nexus_route", "llama3:8b", "--explain", stdout=out)

    text = out.getvalue()
    assert "strategy fleet" in text
    assert (
        "thermal | memory fit | queue | est. wait | affinity | trend | context" in text
    )
    assert "ollama-1" in text and "hot +50" in text and "8B/large +3" in text


@pytest.mark.django_db
def test_the_explain_api_shows_the_signals_per_candidate() -> None:
    RoutingPolicyFactory(strategy="fleet")
    hot = BackendFactory(name="hot", kind="ollama", priority=50)
    BackendModelFactory(backend=hot, name="m", loaded=True, discovered=True)
    cold = BackendFactory(name="cold", kind="ollama", priority=1)
    BackendModelFactory(backend=cold, name="m", discovered=True)
    user = get_user_model().objects.create_user("ops", is_staff=True, is_superuser=True)
    api = APIClient()
    api.force_authenticate(user)

    record = api.post("/api/v1/route/explain", {"model": "m"}, format="json").json()

    assert record["strategy"] == "fleet"
    assert record["chosen"] == {"backend": "hot", "model": "m"}
    by_name = {c["backend"]: c["fleet"] for c in record["candidates"]}
    assert by_name["hot"]["thermal"] == {"value": "hot", "points": 50}
    assert by_name["cold"]["thermal"] == {"value": "on_disk", "points": 10}
    assert len(by_name["hot"]) == 8  # seven signals and the total


# Parsing what Ollama reports.


@pytest.mark.mode_independent
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "2024-06-04T14:38:31.83753-07:00",
            datetime(2024, 6, 4, 21, 38, 31, 837530, UTC),
        ),
        ("2025-01-01T12:00:00.123456789Z", datetime(2025, 1, 1, 12, 0, 0, 123456, UTC)),
        ("0001-01-01T00:00:00Z", None),  # Go's zero time
        ("2318-01-01T00:00:00Z", datetime(2318, 1, 1, tzinfo=UTC)),
        ("9999-01-01T00:00:00Z", None),  # keep_alive -1: never unloads
        ("2025-01-01T12:00:00", None),  # no zone
        ("soon", None),
        (17, None),
    ],
)
def test_ollama_expiry_is_parsed_to_the_microsecond(
    text: object, expected: datetime | None
) -> None:
    assert parse_expiry(text) == expected


@pytest.mark.mode_independent
@pytest.mark.parametrize(
    ("text", "billions"),
    [
        ("70.6B", 70.6),
        ("8B", 8.0),
        ("137M", 0.137),
        ("1.5t", 1500.0),
        ("B", None),
        ("lots", None),
        ("nanB", None),
    ],
)
def test_parameter_size_is_read_in_billions(text: str, billions: float | None) -> None:
    assert parse_parameter_size(text) == (
        pytest.approx(billions) if billions is not None else None
    )


# Settings: admin, REST API, TOML, environment.


def _policy_form(**fields: str) -> dict[str, str]:
    from tests.routing.test_admin import policy_form

    return policy_form(**fields)


@pytest.mark.django_db
def test_the_admin_saves_fleet_settings_and_names_bad_ones(
    admin_client: Client,
) -> None:
    change = reverse("admin:routing_routingpolicy_change", args=(1,))
    RoutingPolicy.load()

    bad = admin_client.post(
        change, _policy_form(strategy="fleet", pre_warm_threshold="0", hot_points="")
    )
    good = admin_client.post(
        change, _policy_form(strategy="fleet", hot_points="70", hold_seconds="")
    )

    errors = bad.context["adminform"].form.errors
    assert "greater than or equal to 1" in str(errors["pre_warm_threshold"])
    assert "required" in str(errors["hot_points"])
    assert good.status_code == 302
    policy = build_snapshot().policy
    assert (policy.fleet.hot_points, policy.hold_seconds) == (70, 30.0)


@pytest.mark.django_db
def test_the_api_reads_and_validates_fleet_settings() -> None:
    user = get_user_model().objects.create_user("ops", is_staff=True, is_superuser=True)
    api = APIClient()
    api.force_authenticate(user)

    defaults = api.get("/api/v1/policy").json()
    bad = api.patch("/api/v1/policy", {"rebalance_max_moves": -1}, format="json")
    good = api.patch(
        "/api/v1/policy",
        {"strategy": "fleet", "fleet_queue_length": 7, "wait_seconds_per_point": 5},
        format="json",
    )
    effective = api.get("/api/v1/config").json()["policy"]["fleet"]

    assert {s.name: defaults[s.name] for s in FLEET_SETTINGS} == {
        s.name: s.default for s in FLEET_SETTINGS
    }
    assert bad.status_code == 400
    assert "greater than or equal to 0" in " ".join(bad.json()["rebalance_max_moves"])
    assert good.status_code == 200, good.content
    assert effective["fleet_queue_length"] == 7
    assert effective["wait_seconds_per_point"] == 5
    assert effective["hold_seconds"] == 30  # the fleet preset


@pytest.mark.django_db
def test_toml_routing_fleet_imports_exports_and_names_bad_keys(tmp_path: Path) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text(
        '[routing]\nstrategy = "fleet"\n[routing.fleet]\n'
        "hot_points = 60\nhold_seconds = 12.5\nfleet_queue_timeout_seconds = 30\n"
    )
    call_command("nexus_import_config", str(path), stdout=StringIO())

    policy = build_snapshot().policy
    assert (policy.fleet.hot_points, policy.hold_seconds) == (60, 12.5)
    assert policy.fleet_queue_timeout_seconds == 30.0
    out = StringIO()
    call_command("nexus_export_config", stdout=out)
    assert "[routing.fleet]\n" in out.getvalue()
    assert "hot_points = 60\n" in out.getvalue()

    path.write_text(
        "[routing.fleet]\npre_warm_threshold = 0\nwarm_points = 1.5\nhotness = 1\n"
    )
    with pytest.raises(CommandError) as caught:
        call_command("nexus_import_config", str(path), stdout=StringIO())
    message = str(caught.value)
    assert (
        "routing.fleet.warm_points: expected a whole number from 0 to 1000" in message
    )
    assert "routing.fleet" in message and "hotness" in message


@pytest.mark.django_db
def test_toml_range_problems_name_the_fleet_key(tmp_path: Path) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text("[routing.fleet]\npre_warm_threshold = 0\n")

    with pytest.raises(CommandError) as caught:
        call_command("nexus_import_config", str(path), stdout=StringIO())

    assert "routing.fleet.pre_warm_threshold: Ensure this value is greater than" in str(
        caught.value
    )


@pytest.mark.mode_independent
def test_env_overrides_are_range_checked_at_startup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values = _load_settings(
        monkeypatch,
        tmp_path,
        NEXUS_ROUTING_FLEET_HOT_POINTS="70",
        NEXUS_ROUTING_FLEET_QUEUE_TIMEOUT_SECONDS="12.5",
    )
    assert values["NEXUS_ROUTING_FLEET"] == {
        "hot_points": 70,
        "fleet_queue_timeout_seconds": 12.5,
    }

    for name, value in (
        ("NEXUS_ROUTING_FLEET_PRE_WARM_THRESHOLD", "0"),
        ("NEXUS_ROUTING_FLEET_HOT_POINTS", "1.5"),
        ("NEXUS_ROUTING_FLEET_HOLD_SECONDS", "nan"),
    ):
        with pytest.raises(ImproperlyConfigured, match=f"^{name} must be"):
            _load_settings(monkeypatch, tmp_path, **{name: value})
        monkeypatch.delenv(name)


@pytest.mark.django_db
def test_env_overrides_reach_the_snapshot(settings: Any) -> None:
    settings.NEXUS_ROUTING_FLEET = {"hot_points": 99, "hold_seconds": 0.0}
    RoutingPolicyFactory(strategy="fleet")

    policy = build_snapshot().policy

    assert (policy.fleet.hot_points, policy.hold_seconds) == (99, 0.0)


@pytest.mark.django_db
def test_a_backend_that_answered_a_request_is_hot_for_the_next_decision(
    mock_backend: MockBackendProcess,
) -> None:
    RoutingPolicyFactory(strategy="fleet")
    for name, priority in (("first", 1), ("second", 2)):
        backend = BackendFactory(
            name=name, base_url=mock_backend.base_url, priority=priority
        )
        BackendModelFactory(backend=backend, name="llama3:8b")
    _, key = ApiKey.objects.create_key("fleet")
    gateway = make_gateway()
    requirements = RequestRequirements(model="llama3:8b")

    def thermal() -> dict[str, str]:
        routes = gateway.snapshots.snapshot.routes
        found = fleet_signals(
            gateway.router.explain(requirements, routes, gateway.stats)
        )
        return {name: s["thermal"]["value"] for name, s in found.items()}

    assert thermal() == {"first": "on_disk", "second": "on_disk"}
    (response,) = asyncio.run(
        serve(
            gateway,
            json={
                "model": "llama3:8b",
                "messages": [{"role": "user", "content": "hi"}],
            },
            headers={"authorization": f"Bearer {key}"},
        )
    )

    assert response.status_code == 200
    assert response.headers["x-nexus-backend"] == "first"  # equal scores: priority
    assert thermal() == {"first": "hot", "second": "on_disk"}
