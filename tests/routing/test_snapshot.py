from __future__ import annotations

from typing import Any

import pytest

from routing.core import Health, Strategy
from routing.models import Alias, RoutingPolicy
from routing.snapshot import build_snapshot
from routing.versioning import read_config_version
from tests.factories import (
    BackendFactory,
    BackendModelFactory,
    ChainStepFactory,
    FallbackChainFactory,
)

pytestmark = pytest.mark.django_db


def test_snapshot_carries_every_routing_table() -> None:
    gpu = BackendFactory(
        name="gpu-1", priority=1, api_key="sk-upstream", max_concurrency=4
    )
    BackendModelFactory(
        backend=gpu, name="llava:7b", context_length=4096, supports_vision=True
    )
    BackendFactory(name="gpu-2", unhealthy=True)
    Alias.objects.create(name="gpt-4", target="llava:7b")
    chain = FallbackChainFactory(model="llava:7b")
    ChainStepFactory(chain=chain, position=1, model="mistral:7b")
    ChainStepFactory(chain=chain, position=0, model="llama3:8b")
    policy = RoutingPolicy.load()
    policy.strategy = Strategy.ROUND_ROBIN
    policy.max_retries = 3
    policy.save()

    snapshot = build_snapshot()

    assert snapshot.version == read_config_version()
    backend = snapshot.backend("gpu-1")
    assert backend is not None
    assert backend.api_key == "sk-upstream"
    assert backend.max_concurrency == 4
    assert backend.status == Health.HEALTHY
    assert snapshot.backend("gpu-2").status == Health.UNHEALTHY
    (target,) = snapshot.targets_for("llava:7b")
    assert target.model.supports_vision and target.model.context_length == 4096
    assert snapshot.aliases == {"gpt-4": "llava:7b"}
    assert snapshot.fallbacks["llava:7b"] == ("llama3:8b", "mistral:7b")
    assert snapshot.policy.strategy == Strategy.ROUND_ROBIN
    assert snapshot.policy.max_retries == 3
    assert "sk-upstream" not in repr(snapshot)


def test_env_overrides_the_stored_policy(settings: Any) -> None:
    RoutingPolicy.load()
    settings.NEXUS_ROUTING_STRATEGY = "priority_only"
    settings.NEXUS_ROUTING_MAX_RETRIES = 5
    snapshot = build_snapshot()
    assert snapshot.policy.strategy == Strategy.PRIORITY_ONLY
    assert snapshot.policy.max_retries == 5


def test_building_takes_a_fixed_number_of_queries(
    django_assert_max_num_queries,
) -> None:
    for index in range(30):
        backend = BackendFactory()
        BackendModelFactory.create_batch(3, backend=backend)
        chain = FallbackChainFactory()
        ChainStepFactory(chain=chain, model=f"fallback-{index}")
    # version, backends, models, aliases, chains, steps, policy, splits + a
    # savepoint pair
    with django_assert_max_num_queries(10):
        snapshot = build_snapshot()
    assert len(snapshot.backends) == 30
