"""A refreshed keep_alive is stored but announces nothing.

An Ollama backend reports each loaded model's keep_alive expiry on /api/ps,
later and later while the model is used (the demo's Ollama mock always
reports "in five minutes"). Announcing each move bumped the configuration
version once a minute, so every serving process rebuilt its snapshot and
logged "Configuration version N is live" with nothing changed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from backends.health import check_all
from backends.models import BackendModel
from routing.snapshot import build_snapshot
from routing.versioning import read_config_version
from tests.backends.mock_fleet import running_mocks
from tests.factories import BackendModelFactory


@pytest.mark.django_db(transaction=True)
def test_a_keep_alive_a_minute_later_bumps_nothing_but_is_read_in_time(
    settings: Any,
) -> None:
    # Health results that stay fresh for an hour: only the model's expiry can
    # make a snapshot expire within the test.
    settings.NEXUS_HEALTH_INTERVAL = 1200
    with running_mocks(("ollama", "--models", "a,b", "--loaded-models", "a")) as (
        mock,
    ):
        backend = mock.register("ollama-1", status="healthy")
        BackendModelFactory(backend=backend, name="a", discovered=True)
        BackendModelFactory(backend=backend, name="b", discovered=True)
        check_all()
        first = BackendModel.objects.get(name="a").expires_at
        assert first is not None
        # As if the round were two minutes ago: this round's expiry is later
        # by two minutes, past the slack under which it is not even stored.
        BackendModel.objects.filter(name="a").update(
            expires_at=first - timedelta(minutes=2)
        )
        before = read_config_version()

        check_all()

        assert read_config_version() == before
        stored = BackendModel.objects.get(name="a").expires_at
        assert stored is not None and stored >= first
        # Every serving process reads it by the time the old one would pass.
        assert build_snapshot().expires_at == stored.timestamp()

        mock.configure(loaded_models=["b"])
        check_all()  # unloading is a change

    assert read_config_version() == before + 1
