from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from routing.models import Alias, RoutingPolicy
from routing.versioning import CONFIG_GROUP, read_config_version
from tests.factories import (
    AliasFactory,
    BackendFactory,
    BackendModelFactory,
    ChainStepFactory,
    FallbackChainFactory,
)

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
