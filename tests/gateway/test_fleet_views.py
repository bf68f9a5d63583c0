"""The dashboard's fleet panel: this serving process's lines, holds and warm-ups."""

from __future__ import annotations

import pytest
from django.test import Client

from gateway.fleet.queues import Waiter
from gateway.process import current_gateway

pytestmark = pytest.mark.django_db


def test_the_fleet_state_is_for_staff_only(client: Client) -> None:
    response = client.get("/dashboard/fleet")
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_staff_see_the_lines_and_warm_ups(admin_client: Client) -> None:
    fleet = current_gateway().fleet
    waiter = Waiter("gpu-1", "llama3:70b", 1.0)
    fleet.queues.join(waiter, 10)
    fleet.recent_prewarms.appendleft(("gpu-2", "llama3:70b", "loaded", 1.7e9))
    fleet.prewarm_total = 1
    try:
        body = admin_client.get("/dashboard/fleet").json()
    finally:
        fleet.queues.leave(waiter)
        fleet.recent_prewarms.clear()
        fleet.prewarm_total = 0
    assert body["lines"] == [{"backend": "gpu-1", "model": "llama3:70b", "waiting": 1}]
    assert body["waiting"] == 1
    assert body["held"] == 0
    assert body["prewarm_total"] == 1
    assert body["prewarms"][0]["backend"] == "gpu-2"
    assert body["prewarms"][0]["outcome"] == "loaded"


def test_the_dashboard_page_has_the_fleet_panel(admin_client: Client) -> None:
    page = admin_client.get("/dashboard/").content.decode()
    assert 'data-fleet-url="/dashboard/fleet"' in page
    assert 'id="fleet-lines"' in page
