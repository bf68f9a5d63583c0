"""NEXUS_ROLE: a gateway-only and a control-only serving process, each a real
Daphne on the test database, with the official openai SDK and a mock backend.

The gateway serves /v1, /health and /metrics and answers a JSON 404 for the
admin, the dashboard and the management API, with none of their machinery
loaded; the control process serves those and answers /v1 with a 404 in
OpenAI's shape naming the gateway.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from nexus_worker.protocol import SECRET_HEADER, CloseCode
from tests import zygote
from tests.conftest import (
    REPO_ROOT,
    MockBackendProcess,
    NexusServer,
    server_env,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey

MESSAGES = [{"role": "user", "content": "hello"}]
WRONG_SECRET = {SECRET_HEADER: "nxw-not-a-worker-secret"}
# What only the control plane loads: a gateway process must load none of it
# (nor, with traces off, the OpenTelemetry SDK).
UNLOADED_MODULES = (
    "django.contrib.admin",
    "django.contrib.staticfiles",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise",
    "axes",
    "drf_spectacular",
    "django_filters",
    "channels.sessions",
    "opentelemetry",
)


@dataclass
class Setup:
    gateway: NexusServer
    control: NexusServer
    mock: MockBackendProcess
    key: str


@pytest.fixture(scope="module")
def setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[Setup]:
    mock = start_mock_backend("--models", "m", "--name", "roles-mock")
    started: list[NexusServer] = []
    try:
        with django_db_blocker.unblock():
            backend = Backend.objects.create(
                name="roles-mock", base_url=mock.base_url, status=HealthStatus.HEALTHY
            )
            BackendModel.objects.create(backend=backend, name="m")
            _, key = ApiKey.objects.create_key("roles")
        started.append(start_nexus_server(NEXUS_ROLE="gateway"))
        started.append(start_nexus_server(NEXUS_ROLE="control"))
        yield Setup(started[0], started[1], mock, key)
    finally:
        for server in started:
            server.stop()
        mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def test_the_gateway_serves_v1_health_and_metrics(setup: Setup) -> None:
    client = openai.OpenAI(
        base_url=f"{setup.gateway.base_url}/v1", api_key=setup.key, max_retries=0
    )
    reply = client.chat.completions.create(model="m", messages=MESSAGES)
    assert reply.choices[0].message.content == "[roles-mock/m] echo: hello"
    base = setup.gateway.base_url
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert httpx.get(f"{base}/health/ready", timeout=10).status_code == 200
    assert httpx.get(f"{base}/health/live", timeout=10).status_code == 200
    assert "nexus_requests_total" in httpx.get(f"{base}/metrics", timeout=10).text


@pytest.mark.parametrize(
    "path",
    [
        "/admin/",
        "/admin/login/",
        "/dashboard/",
        "/api/v1/backends",
        "/api/usage-stream",
        "/static/x",
    ],
)
def test_the_gateway_answers_404_json_for_the_control_plane(
    setup: Setup, path: str
) -> None:
    response = httpx.get(f"{setup.gateway.base_url}{path}", timeout=10)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "not_found"
    assert "NEXUS_ROLE=gateway" in error["message"]
    assert "control processes" in error["message"]


def test_the_control_process_serves_the_admin_and_refuses_model_requests(
    setup: Setup,
) -> None:
    base = setup.control.base_url
    assert httpx.get(f"{base}/admin/login/", timeout=10).status_code == 200
    assert httpx.get(f"{base}/api/v1/backends", timeout=10).status_code in (401, 403)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=setup.key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert "gateway processes" in refused.value.message
    assert httpx.get(f"{base}/health/ready", timeout=10).status_code == 200


def test_relay_workers_belong_to_the_gateway(setup: Setup) -> None:
    async def dial(server: NexusServer) -> tuple[int | None, int | None]:
        """The handshake's refusal status, or the close code once accepted."""
        url = f"{server.base_url.replace('http', 'ws', 1)}/ws/workers"
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(url, headers=WRONG_SECRET) as ws:
                    await ws.receive(timeout=10)
                    return None, ws.close_code
            except aiohttp.WSServerHandshakeError as refused:
                return refused.status, None

    # The gateway serves the relay: a wrong secret is refused as such.
    status, code = asyncio.run(dial(setup.gateway))
    assert status in (401, 403) or code == CloseCode.AUTH_FAILED
    # The control process says where workers belong (nexus-worker explains it).
    assert asyncio.run(dial(setup.control)) == (None, CloseCode.NOT_SERVED_HERE)


def test_a_gateway_process_loads_no_admin_template_static_or_tracing_machinery(
    setup: Setup,
) -> None:
    code = (
        "import sys, django\n"
        "django.setup()\n"
        "import nexus_site.asgi\n"
        "from django.template import engines\n"
        "from django.urls import resolve\n"
        "resolve('/health')\n"
        "print(len(engines.all()))\n"
        f"print(*[m for m in sys.modules if m.startswith({UNLOADED_MODULES!r})])\n"
    )
    env = {k: v for k, v in server_env().items() if not k.startswith("OTEL_")} | {
        "NEXUS_ROLE": "gateway",
        "DJANGO_SETTINGS_MODULE": "nexus_site.settings",
    }
    # Not forked from the tests' zygote: it has imported them all already.
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    engines, loaded = result.stdout.splitlines()[-2:]
    assert engines == "0"
    assert loaded == ""


def test_nexus_run_stays_all_in_one(setup: Setup) -> None:
    env = server_env() | {"NEXUS_ROLE": "gateway"}
    result = zygote.run(
        [sys.executable, "manage.py", "nexus_run"], cwd=REPO_ROOT, env=env, timeout=60
    )
    assert result.returncode != 0
    assert "nexus_run serves every role in one" in result.stderr
    assert "Unset NEXUS_ROLE" in result.stderr
