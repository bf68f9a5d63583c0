from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction
from django.utils import timezone

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import Alias, RoutingPolicy
from routing.versioning import (
    CONFIG_GROUP,
    bump_and_broadcast,
    config_changes_deferred,
    read_config_version,
)
from tests.factories import (
    AliasFactory,
    ApiKeyFactory,
    BackendFactory,
    BackendModelFactory,
    ChainStepFactory,
    FallbackChainFactory,
)
from usage.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    "make",
    [
        BackendFactory,
        BackendModelFactory,
        AliasFactory,
        FallbackChainFactory,
        ChainStepFactory,
        RoutingPolicy.load,
    ],
    ids=["backend", "backend-model", "alias", "chain", "chain-step", "policy"],
)
def test_every_routing_change_bumps_the_version(make) -> None:
    before = read_config_version()
    make()
    assert read_config_version() > before


def test_a_delete_bumps_the_version() -> None:
    alias = AliasFactory()
    before = read_config_version()
    alias.delete()
    assert read_config_version() == before + 1


def test_deferred_changes_are_noted_not_bumped_until_the_caller_bumps() -> None:
    """How a relay worker's churn is coalesced (gateway/relay/churn.py)."""
    before = read_config_version()
    with config_changes_deferred() as changes:
        BackendFactory()
        AliasFactory()
    assert changes.changed
    assert read_config_version() == before
    assert bump_and_broadcast() == before + 1
    BackendFactory()  # outside the block: bumped on commit as ever
    assert read_config_version() == before + 2


def test_a_deferred_change_rolled_back_is_not_noted() -> None:
    with (
        config_changes_deferred() as changes,
        pytest.raises(RuntimeError),
        transaction.atomic(),
    ):
        BackendFactory()
        raise RuntimeError
    assert not changes.changed


def test_many_changes_in_one_transaction_bump_once() -> None:
    before = read_config_version()
    with transaction.atomic():
        backend = BackendFactory()
        for _ in range(5):
            BackendModelFactory(backend=backend)
        AliasFactory()
    assert read_config_version() == before + 1


def test_rolled_back_changes_do_not_bump() -> None:
    before = read_config_version()
    with pytest.raises(RuntimeError), transaction.atomic():
        AliasFactory()
        raise RuntimeError("abort")
    assert read_config_version() == before
    assert not Alias.objects.exists()


def test_change_after_a_rolled_back_savepoint_still_bumps() -> None:
    before = read_config_version()
    with transaction.atomic():
        try:
            with transaction.atomic():
                AliasFactory(name="dropped")
                raise RuntimeError("roll back the savepoint only")
        except RuntimeError:
            pass
        AliasFactory(name="kept")
    assert read_config_version() == before + 1


def test_draining_and_undraining_backends_bump_the_version() -> None:
    BackendFactory(name="a", status=HealthStatus.HEALTHY)
    BackendFactory(name="b", status=HealthStatus.HEALTHY)
    before = read_config_version()
    assert Backend.objects.drain() == ["a", "b"]
    assert read_config_version() == before + 1
    assert Backend.objects.drain() == []
    assert read_config_version() == before + 1
    assert len(Backend.objects.undrain()) == 2
    assert read_config_version() == before + 2
    assert set(Backend.objects.values_list("status", flat=True)) == {"unknown"}


def test_bulk_writes_of_lower_apps_bump_once_per_transaction() -> None:
    model = BackendModelFactory(loaded=False)
    ApiKeyFactory()
    before = read_config_version()
    with transaction.atomic():
        Backend.objects.drain()
        BackendModel.objects.filter(pk=model.pk).set_loaded({model.name})
        BackendModel.objects.announce_change()
        ApiKey.objects.deactivate()
    assert read_config_version() == before + 1


def test_saving_only_when_a_key_was_last_used_does_not_bump() -> None:
    key = ApiKeyFactory()
    before = read_config_version()
    key.last_used_at = timezone.now()
    key.save(update_fields=["last_used_at"])
    assert read_config_version() == before
    key.name = "renamed"
    key.save()
    assert read_config_version() == before + 1


def test_committed_change_is_broadcast_on_the_channel_layer() -> None:
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(CONFIG_GROUP, channel)
    try:
        AliasFactory()
        expected = read_config_version()

        async def receive() -> dict:
            return await asyncio.wait_for(layer.receive(channel), timeout=5)

        message = async_to_sync(receive)()
        assert message == {"type": "config.changed", "version": expected}
    finally:
        async_to_sync(layer.group_discard)(CONFIG_GROUP, channel)
