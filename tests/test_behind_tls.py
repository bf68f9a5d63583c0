"""Nexus behind a TLS-terminating proxy (NEXUS_BEHIND_TLS), as the proxy sees it."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.conftest import NexusServer

HTTPS = {"X-Forwarded-Proto": "https", "Host": "127.0.0.1"}


@pytest.mark.django_db(transaction=True)
def test_behind_tls_redirects_plain_http_and_sends_hsts_and_secure_cookies(
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    server = nexus_server_factory(NEXUS_BEHIND_TLS="true")
    url = server.base_url

    plain = httpx.get(f"{url}/admin/login/", follow_redirects=False)
    assert plain.status_code == 301
    assert plain.headers["Location"].startswith("https://")

    secure = httpx.get(f"{url}/admin/login/", headers=HTTPS, follow_redirects=False)
    assert secure.status_code == 200
    assert secure.headers["Strict-Transport-Security"] == (
        "max-age=31536000; includeSubDomains"
    )
    cookie = secure.headers["Set-Cookie"]
    assert cookie.startswith("csrftoken=") and "Secure" in cookie

    # Load balancers check health over plain HTTP inside the network.
    assert httpx.get(f"{url}/health").status_code in (200, 503)
    assert httpx.get(f"{url}/health/ready").status_code == 200
