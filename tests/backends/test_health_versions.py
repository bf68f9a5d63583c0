"""Server versions: read by the health round from real mocks of each kind.

Each kind says its version its own way (Ollama /api/version, llama.cpp
/props build_info, vLLM /version; OpenAI-compatible servers do not say). The
round reads it after a good probe, bounded in size and time, and a version
that cannot be read never costs a healthy backend its health. Requests never
ask for it. Staff see versions in the admin, the API and /health; anonymous
callers of /health do not.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.authtoken.models import Token

from backends.health import check_all
from backends.models import Backend, BackendModel, HealthStatus
from tests.backends.mock_fleet import running_mocks
from tests.conftest import NexusServer, mock_stats
from tests.factories import BackendFactory
from usage.models import ApiKey

pytestmark = pytest.mark.django_db


def test_a_health_round_records_each_kind_s_server_version() -> None:
    with running_mocks(
        ("ollama", "--models", "llama3:8b", "--version", "0.6.2"),
        ("llamacpp", "--models", "qwen3:4b", "--version", "b6123-4a5b6c7"),
        ("vllm", "--models", "mistral:7b", "--version", "0.9.1"),
        ("openai", "--models", "gpt-4o"),
    ) as mocks:
        for mock in mocks:
            mock.register(f"{mock.kind}-1")
        reports = {report.name: report for report in check_all()}

    versions = dict(Backend.objects.values_list("name", "server_version"))
    assert versions == {
        "ollama-1": "0.6.2",
        "llamacpp-1": "b6123-4a5b6c7",
        "vllm-1": "0.9.1",
        "openai-1": "",  # OpenAI-compatible servers do not say
    }
    assert {name: r.status for name, r in reports.items()} == dict.fromkeys(
        versions, "healthy"
    )
    assert reports["ollama-1"].as_dict()["version"] == "0.6.2"


def test_a_new_version_replaces_the_old_one_on_the_next_round() -> None:
    with running_mocks(("ollama", "--models", "llama3:8b", "--version", "0.6.2")) as (
        mock,
    ):
        mock.register("ollama-1")
        check_all()
        mock.configure(server_version="0.7.0")  # upgraded in place
        check_all()
    assert Backend.objects.get().server_version == "0.7.0"


@pytest.mark.django_db(transaction=True)
def test_versions_are_read_on_the_health_round_and_never_on_a_request(
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    with running_mocks(("ollama", "--models", "llama3:8b", "--version", "0.6.2")) as (
        mock,
    ):
        backend = mock.register("ollama-1", status=HealthStatus.HEALTHY)
        BackendModel.objects.create(backend=backend, name="llama3:8b")
        _, key = ApiKey.objects.create_key("versions")
        server = nexus_server_factory()
        sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key)
        for text in ("one", "two", "three"):
            sdk.chat.completions.create(
                model="llama3:8b", messages=[{"role": "user", "content": text}]
            )
        asked = mock_stats(mock.process)["requests"]
        assert asked.get("/api/chat", 0) + asked.get("/v1/chat/completions", 0) == 3
        assert "/api/version" not in asked

        check_all()
        assert mock_stats(mock.process)["requests"]["/api/version"] == 1
    assert Backend.objects.get().server_version == "0.6.2"


def test_a_version_endpoint_refusing_the_key_keeps_the_backend_healthy() -> None:
    # llama.cpp's /health needs no key; its /props does.
    with running_mocks(
        ("llamacpp", "--models", "qwen3:4b", "--api-key", "right-key")
    ) as (mock,):
        mock.register(
            "llamacpp-1",
            api_key="wrong-key",
            status=HealthStatus.HEALTHY,
            server_version="b5999-old",
        )
        (report,) = check_all()
    assert report.status == "healthy"
    assert report.error == ""
    assert Backend.objects.get().server_version == "b5999-old"  # kept as it was


class _VersionServer(BaseHTTPRequestHandler):
    """An Ollama that answers its probe but not its version as it should."""

    mode = "hang"
    release = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/api/ps":
            self._send(json.dumps({"models": []}).encode())
        elif self.mode == "hang":
            type(self).release.wait(30)
        else:  # a valid answer, but megabytes of it
            body = json.dumps({"version": "9" * (4 * 1024 * 1024)}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            try:
                for start in range(0, len(body), 65536):
                    self.wfile.write(body[start : start + 65536])
            except OSError:
                pass  # the health round stopped reading

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _version_server(mode: str) -> Iterator[str]:
    handler = type("Handler", (_VersionServer,), {"mode": mode})
    handler.release = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


def test_a_version_that_never_comes_does_not_fail_the_probe(settings) -> None:
    settings.NEXUS_HEALTH_PROBE_TIMEOUT = 2.0
    with _version_server("hang") as url:
        BackendFactory(
            name="ollama-1", kind="ollama", base_url=url, server_version="0.5.1"
        )
        (report,) = check_all()
    assert report.status == "healthy"
    assert report.error == ""
    assert Backend.objects.get().server_version == "0.5.1"


def test_a_version_answer_of_megabytes_is_not_read_to_the_end(settings) -> None:
    settings.NEXUS_HEALTH_PROBE_TIMEOUT = 10.0
    with _version_server("huge") as url:
        BackendFactory(
            name="ollama-1", kind="ollama", base_url=url, server_version="0.5.1"
        )
        (report,) = check_all()
    assert report.status == "healthy"
    # Read whole, it would have been stored (cut to 100 characters).
    assert Backend.objects.get().server_version == "0.5.1"


def test_the_admin_list_and_change_page_show_the_version(admin_client: Client) -> None:
    backend = BackendFactory(name="gpu-1", kind="ollama", server_version="0.6.2")
    BackendFactory(name="gpu-2", kind="openai")
    listing = admin_client.get("/admin/backends/backend/").content.decode()
    # Under the kind, so that the list still fits a 1280 px screen.
    assert (
        '<td class="field-kind_version">Ollama<br><small title="0.6.2" '
        'style="white-space:nowrap">0.6.2</small></td>'
    ) in listing
    assert '<td class="field-kind_version">OpenAI-compatible</td>' in listing
    page = admin_client.get(f"/admin/backends/backend/{backend.pk}/change/")
    assert "0.6.2" in page.content.decode()
    # Read-only: a form post cannot set it.
    assert 'name="server_version"' not in page.content.decode()


def test_the_api_shows_the_version_read_only(admin_user) -> None:
    backend = BackendFactory(name="gpu-1", kind="vllm", server_version="0.9.1")
    token = Token.objects.create(user=admin_user)
    api = Client(HTTP_AUTHORIZATION=f"Token {token.key}")
    url = f"/api/v1/backends/{backend.pk}"
    assert api.get(url).json()["server_version"] == "0.9.1"
    refused = api.patch(
        url, {"server_version": "6.6.6"}, content_type="application/json"
    )
    assert refused.status_code == 400
    assert refused.json()["server_version"] == ["This field is read-only."]
    backend.refresh_from_db()
    assert backend.server_version == "0.9.1"


def test_health_shows_versions_to_staff_only(client: Client) -> None:
    BackendFactory(name="gpu-1", kind="ollama", server_version="0.6.2", priority=1)
    BackendFactory(name="cloud", kind="openai", priority=2)
    anonymous = client.get("/health")
    assert anonymous.status_code == 200
    assert "0.6.2" not in anonymous.content.decode()
    assert "backends" not in anonymous.json()

    staff = get_user_model().objects.create_user(
        "ops", is_staff=True, is_superuser=True
    )
    token = Token.objects.create(user=staff)
    rows = client.get("/health", HTTP_AUTHORIZATION=f"Token {token.key}").json()[
        "backends"
    ]
    assert [(row["name"], row["version"]) for row in rows] == [
        ("gpu-1", "0.6.2"),
        ("cloud", None),
    ]
