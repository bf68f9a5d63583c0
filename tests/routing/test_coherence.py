"""Every serving process routes with a change within the coherence bound.

Real Daphne processes serve Nexus on the test database; changes are made by
this process (as the admin, the REST API or a Celery task would) and by a
management command in a process of its own. The bound is part of the product's
contract: 1 s in production mode (Redis broadcast), 3 s in the embedded default
(periodic version check).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from routing.models import Alias
from tests.conftest import REPO_ROOT, NexusServer, server_env, spare_redis_url
from tests.factories import BackendFactory, BackendModelFactory

pytestmark = pytest.mark.django_db(transaction=True)

SET_GPU1_UNHEALTHY = (
    "from backends.models import Backend; "
    "b = Backend.objects.get(name='gpu-1'); b.status = 'unhealthy'; b.save()"
)
BOUND_SECONDS = 1.0 if os.environ.get("NEXUS_TEST_MODE") == "production" else 3.0
# The periodic version check runs every NEXUS_CONFIG_POLL_INTERVAL (1 s).
POLL_BOUND_SECONDS = 3.0


@pytest.fixture
def token() -> str:
    user = get_user_model().objects.create_user("ops", is_staff=True, is_superuser=True)
    return Token.objects.create(user=user).key


def _explain(server: NexusServer, token: str, model: str) -> dict:
    response = httpx.post(
        f"{server.base_url}/api/v1/route/explain",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Token {token}"},
        timeout=5,
    )
    assert response.status_code == 200, response.text
    return response.json()


def _wait_until(check: Callable[[], bool], limit: float) -> float:
    """Poll check() until true; return the seconds it took (fails past limit)."""
    start = time.monotonic()
    while not check():
        elapsed = time.monotonic() - start
        assert elapsed < limit, f"not seen within {limit} s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_change_reaches_every_serving_process_within_the_bound(
    nexus_server_factory: Callable[..., NexusServer], token: str
) -> None:
    backend = BackendFactory(name="gpu-1")
    BackendModelFactory(backend=backend, name="llama3:8b")
    servers = [nexus_server_factory(), nexus_server_factory()]
    for server in servers:
        chosen = _explain(server, token, "llama3:8b")["chosen"]
        assert chosen == {"backend": "gpu-1", "model": "llama3:8b"}
        assert _explain(server, token, "gpt-4")["error"]["status"] == 404

    # Changed by this process, as the admin or a Celery task would.
    Alias.objects.create(name="gpt-4", target="llama3:8b")
    for server in servers:
        _wait_until(
            lambda s=server: _explain(s, token, "gpt-4")["via"] == "alias",
            BOUND_SECONDS,
        )

    # Changed by a management command in a process of its own.
    result = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "shell",
            "-c",
            SET_GPU1_UNHEALTHY,
        ],
        cwd=REPO_ROOT,
        env=server_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for server in servers:
        _wait_until(
            lambda s=server: _explain(s, token, "llama3:8b")["error"] is not None,
            BOUND_SECONDS,
        )


CHURN_CHANGES = 30


def test_no_request_fails_while_snapshots_are_rebuilt(
    nexus_server_factory: Callable[..., NexusServer], token: str
) -> None:
    backend = BackendFactory(name="gpu-1")
    BackendModelFactory(backend=backend, name="llama3:8b")
    server = nexus_server_factory()
    _explain(server, token, "llama3:8b")

    # A number of changes, not a number of seconds: a loaded machine makes each
    # write slower (SQLite's lock), and the point is that requests keep being
    # routed while the snapshot is rebuilt again and again.
    churned = threading.Event()
    failures: list[str] = []

    def hammer() -> int:
        count = 0
        with httpx.Client(timeout=5) as client:
            while not churned.is_set() or count == 0:
                response = client.post(
                    f"{server.base_url}/api/v1/route/explain",
                    json={"model": "llama3:8b"},
                    headers={"Authorization": f"Token {token}"},
                )
                if response.status_code != 200 or response.json()["chosen"] is None:
                    failures.append(response.text)
                count += 1
        return count

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(hammer) for _ in range(4)]
        try:
            for change in range(CHURN_CHANGES):
                Alias.objects.update_or_create(
                    name="churn", defaults={"target": f"model-{change}"}
                )
                time.sleep(0.02)
        finally:
            churned.set()
        served = sum(f.result() for f in futures)
    assert served >= 4
    assert failures == []


def test_a_revoked_client_key_is_refused_everywhere_within_the_bound(
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    from usage.models import ApiKey

    key, raw = ApiKey.objects.create_key("soon-revoked")
    servers = [nexus_server_factory(), nexus_server_factory()]

    def status(server: NexusServer) -> int:
        return httpx.get(
            f"{server.base_url}/v1/models",
            headers={"Authorization": f"Bearer {raw}"},
            timeout=5,
        ).status_code

    assert [status(s) for s in servers] == [200, 200]
    ApiKey.objects.filter(pk=key.pk).deactivate()
    for server in servers:
        _wait_until(lambda s=server: status(s) == 401, BOUND_SECONDS)


def test_the_periodic_check_alone_converges_without_broadcasts(
    nexus_server_factory: Callable[..., NexusServer], token: str
) -> None:
    backend = BackendFactory(name="gpu-1")
    BackendModelFactory(backend=backend, name="llama3:8b")
    # A channel layer of its own (another Redis database in production mode; the
    # in-memory layer is per process anyway): no broadcast from here reaches it.
    own_layer = {"REDIS_URL": spare_redis_url()} if settings.REDIS_URL else {}
    server = nexus_server_factory(**own_layer)
    assert _explain(server, token, "gpt-4")["error"]["status"] == 404

    Alias.objects.create(name="gpt-4", target="llama3:8b")
    _wait_until(
        lambda: _explain(server, token, "gpt-4")["via"] == "alias",
        POLL_BOUND_SECONDS,
    )
