"""Relay workers' secrets: the command, the API and the admin.

What a worker does once connected is tested end to end in
tests/gateway/test_relay_e2e.py.
"""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib.messages import get_messages
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from backends.kinds import LoadedModel
from backends.models import Backend, BackendModel, HealthStatus, Worker
from backends.workers import (
    WorkerState,
    record_worker_states,
    register_worker,
    see_workers,
    sweep_silent_workers,
)
from nexus_worker import protocol
from tests.factories import BackendFactory, StaffUserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def api() -> APIClient:
    token = Token.objects.create(user=StaffUserFactory())
    return APIClient(HTTP_AUTHORIZATION=f"Token {token.key}")


def test_the_command_prints_the_secret_once_and_stores_only_its_hash() -> None:
    out = StringIO()
    call_command("nexus_create_worker", "gpu-1", "--json", stdout=out)
    printed = json.loads(out.getvalue())
    worker = Worker.objects.get(name="gpu-1")
    assert printed["secret"].startswith("nxw-")
    assert printed["prefix"] == worker.prefix == printed["secret"][:12]
    assert printed["secret"] not in (worker.hashed_secret, worker.prefix)
    assert Worker.objects.for_secret(printed["secret"]) == worker
    assert Worker.objects.for_secret(printed["secret"] + "x") is None


def test_the_command_refuses_a_name_an_ordinary_backend_has() -> None:
    BackendFactory(name="gpu-1")
    with pytest.raises(CommandError, match="not a relay worker"):
        call_command("nexus_create_worker", "gpu-1", stdout=StringIO())


def test_api_shows_the_secret_on_create_and_rotate_only(api: APIClient) -> None:
    created = api.post("/api/v1/workers", {"name": "gpu-1"}, format="json")
    assert created.status_code == 201
    secret = created.json()["secret"]
    listed = api.get("/api/v1/workers").json()["results"]
    assert [row["name"] for row in listed] == ["gpu-1"]
    assert "secret" not in listed[0]
    assert secret not in json.dumps(listed)

    pk = created.json()["id"]
    rotated = api.post(f"/api/v1/workers/{pk}/rotate").json()
    assert rotated["secret"] != secret
    assert Worker.objects.for_secret(secret) is None
    assert Worker.objects.for_secret(rotated["secret"]) is not None


def test_api_revoke_refuses_the_secret_and_takes_the_backend_out(
    api: APIClient,
) -> None:
    worker, secret = Worker.objects.create_worker("gpu-1")
    register_worker(worker.pk, "chan-1", "10.0.0.5", ["llama3:8b"], 2)
    backend = Backend.objects.get(name="gpu-1")
    assert (backend.kind, backend.status, backend.max_concurrency) == (
        "relay",
        HealthStatus.HEALTHY,
        2,
    )
    assert list(backend.models.values_list("name", "discovered")) == [
        ("llama3:8b", True)
    ]

    answer = api.post(f"/api/v1/workers/{worker.pk}/revoke")
    assert answer.status_code == 200
    assert answer.json()["is_active"] is False
    assert Worker.objects.for_secret(secret) is None
    assert Backend.objects.get(name="gpu-1").status == HealthStatus.UNHEALTHY


def test_api_refuses_a_duplicate_name(api: APIClient) -> None:
    Worker.objects.create_worker("gpu-1")
    answer = api.post("/api/v1/workers", {"name": "gpu-1"}, format="json")
    assert answer.status_code == 400
    assert "name" in answer.json()


def test_admin_add_shows_the_secret_once(admin_client: Client) -> None:
    response = admin_client.post(
        "/admin/backends/worker/add/", {"name": "gpu-1"}, follow=True
    )
    assert response.status_code == 200
    texts = [str(message) for message in get_messages(response.wsgi_request)]
    worker = Worker.objects.get(name="gpu-1")
    shown = [text for text in texts if "<code>nxw-" in text]
    assert len(shown) == 1
    secret = shown[0].split("<code>")[1].split("</code>")[0]
    assert Worker.objects.for_secret(secret) == worker


def test_admin_changelist_and_actions(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    for name in ("gpu-1", "gpu-2", "gpu-3"):
        worker, _ = Worker.objects.create_worker(name)
        register_worker(worker.pk, f"chan-{name}", "10.0.0.5", ["m"], 1)
    with django_assert_max_num_queries(10):
        page = admin_client.get("/admin/backends/worker/")
    assert page.status_code == 200
    assert b"10.0.0.5" in page.content

    gpu1 = Worker.objects.get(name="gpu-1")
    response = admin_client.post(
        "/admin/backends/worker/",
        {"action": "drain_workers", "_selected_action": [gpu1.pk]},
        follow=True,
    )
    assert response.status_code == 200
    assert Backend.objects.get(name="gpu-1").status == HealthStatus.DRAINING
    assert Backend.objects.get(name="gpu-2").status == HealthStatus.HEALTHY

    admin_client.post(
        "/admin/backends/worker/",
        {"action": "revoke_workers", "_selected_action": [gpu1.pk]},
    )
    assert not Worker.objects.get(name="gpu-1").is_active


def test_a_heartbeat_brings_an_undrained_worker_back() -> None:
    worker, _ = Worker.objects.create_worker("gpu-1")
    register_worker(worker.pk, "chan-1", "10.0.0.5", ["m"], 1)
    backends = Backend.objects.filter(name="gpu-1")
    backends.drain()
    assert see_workers({worker.pk: "chan-1"}) == set()
    assert backends.get().status == HealthStatus.DRAINING  # stays drained
    backends.undrain()
    assert backends.get().status == HealthStatus.UNKNOWN
    assert see_workers({worker.pk: "chan-1"}) == set()
    assert backends.get().status == HealthStatus.HEALTHY
    assert see_workers({worker.pk: "an-old-connection"}) == {worker.pk}


def test_a_sweep_makes_silent_workers_gone_and_a_heartbeat_claims_one_back() -> None:
    for name in ("dead", "mine", "fresh"):
        worker, _ = Worker.objects.create_worker(name)
        register_worker(worker.pk, f"chan-{name}", "10.0.0.5", ["m"], 1)
    long_ago = timezone.now() - timedelta(seconds=60)
    Worker.objects.filter(name__in=("dead", "mine")).update(last_seen_at=long_ago)

    # "mine" is held by the sweeping process itself: its own heartbeats judge it.
    assert sweep_silent_workers(15.0, keep=["chan-mine"]) == ["dead"]
    assert Worker.objects.get(name="dead").channel_name == ""
    assert Backend.objects.get(name="dead").status == HealthStatus.UNHEALTHY
    assert Backend.objects.get(name="fresh").status == HealthStatus.HEALTHY
    assert Worker.objects.get(name="mine").channel_name == "chan-mine"

    # Its process had only stalled: the next heartbeat there claims it back.
    dead = Worker.objects.get(name="dead")
    assert see_workers({dead.pk: "chan-dead"}) == set()
    assert Worker.objects.get(name="dead").channel_name == "chan-dead"
    assert Backend.objects.get(name="dead").status == HealthStatus.HEALTHY
    # A connection that took its place elsewhere is not taken back.
    register_worker(dead.pk, "chan-new", "10.0.0.6", ["m"], 1)
    assert see_workers({dead.pk: "chan-dead"}) == {dead.pk}


def test_heartbeats_of_many_workers_are_noted_in_a_few_statements(
    django_assert_max_num_queries: Any,
) -> None:
    channels = {}
    for index in range(30):
        worker, _ = Worker.objects.create_worker(f"gpu-{index}")
        register_worker(worker.pk, f"chan-{index}", "10.0.0.5", ["m"], 1)
        channels[worker.pk] = f"chan-{index}"
    revoked = Worker.objects.get(name="gpu-3")
    Worker.objects.filter(pk=revoked.pk).revoke()
    before = timezone.now()
    with django_assert_max_num_queries(5):
        lost = see_workers(channels)
    assert lost == {revoked.pk}
    assert Worker.objects.filter(last_seen_at__gte=before).count() == 29


def test_a_workers_reported_state_lands_where_a_health_round_puts_it() -> None:
    worker, _ = Worker.objects.create_worker("gpu-1")
    register_worker(worker.pk, "chan-1", "10.0.0.5", ["a", "b"], 8)
    expires = timezone.now() + timedelta(minutes=5)
    state = WorkerState(
        loaded=frozenset({"a"}),
        details={
            "a": LoadedModel(
                vram_bytes=5 * 10**9, context_length=4096, expires_at=expires
            )
        },
        memory_gb=24.0,
        max_concurrency=2,
    )
    record_worker_states({worker.pk: state})
    backend = Backend.objects.get(name="gpu-1")
    # Where a health round puts a server's report; the operator's
    # memory_ceiling_gb (an override) is left alone.
    assert (backend.memory_total_bytes, backend.memory_used_bytes) == (
        24 * 10**9,
        5 * 10**9,
    )
    assert backend.memory_ceiling_gb is None
    assert (backend.slots, backend.max_concurrency) == (2, 2)
    a, b = BackendModel.objects.filter(backend=backend).order_by("name")
    assert (a.loaded, a.vram_bytes, a.loaded_context_length) == (True, 5 * 10**9, 4096)
    assert a.expires_at == expires
    assert not b.loaded
    # Unknown (an older worker, a server that does not say) changes nothing.
    record_worker_states({worker.pk: WorkerState()})
    assert BackendModel.objects.get(backend=backend, name="a").loaded


def test_protocol_and_database_agree_on_model_name_lengths() -> None:
    """Red team (issue 27): names of 201-256 characters passed the protocol
    but not the 200-character column, and the whole update was dropped."""
    longest = "m" * BackendModel._meta.get_field("name").max_length
    update = protocol.encode(protocol.ModelsUpdate(models=[longest, "n"]))
    worker, _ = Worker.objects.create_worker("gpu-1")
    models = protocol.decode(update).models  # type: ignore[union-attr]
    register_worker(worker.pk, "chan-1", "10.0.0.5", models, 1)
    served = BackendModel.objects.filter(backend__name="gpu-1")
    assert set(served.values_list("name", flat=True)) == {longest, "n"}
    longer = protocol.encode(protocol.ModelsUpdate(models=[longest + "m"]))
    with pytest.raises(protocol.ProtocolError, match="longer than 200"):
        protocol.decode(longer)
