"""Slow and oversized clients under uvicorn and granian, as ``nexus_run`` starts them.

The servers run with the command lines ``nexus_run --server uvicorn|granian``
uses (nexus_site.servers.serving.server_commands), on raw sockets: a client dripping
its head is disconnected after ``NEXUS_CLIENT_HEADER_TIMEOUT`` (uvicorn: with a
408), one dripping its body gets the proxy's 408 after
``NEXUS_CLIENT_BODY_TIMEOUT``, and a chunked body with a valid key is cut with
a 413 as it passes ``NEXUS_MAX_BODY_BYTES``. Daphne's own are in
tests/test_daphne_limits.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from django.core.management import call_command

from backends.models import Backend, HealthStatus
from nexus_mock import MockBackendProcess
from nexus_site.servers.serving import server_commands
from tests.conftest import (
    HEAD_OF_MEGABYTES,
    REPO_ROOT,
    _free_port,
    mock_stats,
    send_a_head_of_megabytes,
    server_env,
    start_mock_backend,
    wait_until,
)
from usage.models import ApiKey

MAX_BODY = 100_000
PATH = "/v1/chat/completions"
SERVERS = ["uvicorn", "granian"]


@dataclass
class Served:
    server: str
    port: int
    key: str

    def connect(self) -> socket.socket:
        # A server that never cuts the client off fails the test here (recv
        # times out) instead of hanging it.
        return socket.create_connection(("127.0.0.1", self.port), timeout=20)


@pytest.fixture(scope="module", params=SERVERS)
def served(
    request: pytest.FixtureRequest, django_db_setup: None, django_db_blocker
) -> Iterator[Served]:
    server = request.param
    pytest.importorskip(server)
    with django_db_blocker.unblock():
        _, key = ApiKey.objects.create_key(f"deadlines-{server}")
    port = _free_port()
    listener = socket.create_server(("127.0.0.1", port))
    (command,) = server_commands(
        server,
        fd=listener.fileno(),
        host="127.0.0.1",
        port=port,
        workers=1,
        header_timeout=1.0,
    )
    if server == "granian":
        listener.close()  # granian binds the port itself, as under nexus_run
    env = server_env() | {
        "NEXUS_MAX_BODY_BYTES": str(MAX_BODY),
        "NEXUS_CLIENT_BODY_TIMEOUT": "1",
        "NEXUS_ACCESS_LOG": "0",
    }
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=env,
        pass_fds=() if server == "granian" else (listener.fileno(),),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    listener.close()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # up, with the key in its configuration
            with contextlib.suppress(httpx.HTTPError):
                answer = httpx.get(
                    f"{base}/v1/models",
                    headers={"authorization": f"Bearer {key}"},
                    timeout=2,
                )
                if answer.status_code == 200:
                    break
            assert process.poll() is None, f"{server} exited"
            assert time.monotonic() < deadline, f"{server} did not start"
            time.sleep(0.2)
        yield Served(server, port, key)
    finally:
        MockBackendProcess(process, base).stop()  # type: ignore[arg-type]
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _response(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _head(key: str, extra: str) -> bytes:
    return (
        f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {key}\r\n"
        f"{extra}\r\n"
    ).encode()


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_a_client_dripping_its_head_is_disconnected(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(f"POST {PATH} HTTP/1.1\r\nHost: 127".encode())
        data = _read_until_closed(sock)  # the server's deadline ends it
    if served.server == "uvicorn":
        status, body = _response(data)
        assert status == 408
        assert body["error"]["code"] == "request_timeout"
    else:  # granian closes the connection (with its own 408 or nothing)
        assert not data or data.startswith(b"HTTP/1.1 408")


def test_a_client_dripping_its_body_gets_a_408(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(_head(served.key, "Content-Length: 1000\r\n") + b'{"model": ')
        data = _read_until_closed(sock)
    status, body = _response(data)
    assert status == 408
    assert body["error"]["code"] == "request_timeout"
    assert "body" in body["error"]["message"]


def test_a_chunked_body_with_a_valid_key_is_cut_at_the_limit(served: Served) -> None:
    chunk = b"x" * 30_000
    sent = 0
    with served.connect() as sock:
        sock.sendall(_head(served.key, "Transfer-Encoding: chunked\r\n"))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent <= MAX_BODY * 4:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        data = _read_until_closed(sock)
    status, body = _response(data)
    assert status == 413
    assert body["error"]["code"] == "request_too_large"


def test_a_head_of_megabytes_is_refused_not_held(served: Served) -> None:
    # 8 MiB of header lines, sent as fast as the server takes them: the server
    # refuses (4xx) or hangs up before the end, instead of holding them.
    with served.connect() as sock:
        sent, data = send_a_head_of_megabytes(sock, PATH)
    assert sent < HEAD_OF_MEGABYTES or data.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4"))


@pytest.mark.parametrize("path", ["/admin/login/", "/api/v1/backends/"])
def test_django_pages_bound_a_body_too(served: Served, path: str) -> None:
    # Django itself would wait for ever and spool any size (to disk).
    with served.connect() as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\n"
            "Content-Length: 1000\r\n\r\nusername=".encode()
        )
        status, body = _response(_read_until_closed(sock))
    assert status == 408
    assert body["error"]["code"] == "request_timeout"
    chunk = b"x" * 30_000
    with served.connect() as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(8):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, body = _response(_read_until_closed(sock))
    assert status == 413
    assert body["error"]["code"] == "request_too_large"


def test_a_model_file_goes_on_as_it_arrives(
    served: Served, django_db_blocker: Any
) -> None:
    """An Ollama model file (over the body limit, a file's own) is passed to
    the backend as the server hands it over, with a length or chunked."""
    mock = start_mock_backend("--kind", "ollama", "--models", "m", "--name", "files")
    name = f"files-{served.server}"
    try:
        with django_db_blocker.unblock():
            Backend.objects.create(
                name=name,
                base_url=mock.base_url,
                kind="ollama",
                status=HealthStatus.HEALTHY,
            )
            _, key = ApiKey.objects.create_key(f"ops-{name}", can_manage_models=True)
        data = bytes(range(256)) * (3 * MAX_BODY // 256)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        url = f"http://127.0.0.1:{served.port}/api/blobs/{digest}?backend={name}"
        headers = {"authorization": f"Bearer {key}"}

        def chunked() -> Iterator[bytes]:
            for start in range(0, len(data), 65536):
                yield data[start : start + 65536]

        def stored() -> bool:
            answer = httpx.post(url, content=chunked(), headers=headers, timeout=10)
            # 401/404 until this server's configuration has the key and backend.
            assert answer.status_code in (201, 401, 404), answer.text
            return answer.status_code == 201

        wait_until(stored, what="the upload to reach the backend")
        assert mock_stats(mock)["blob_bytes"] == len(data)
        again = httpx.post(url, content=data, headers=headers, timeout=10)
        assert again.status_code == 200  # the backend has it
        assert httpx.head(url, headers=headers, timeout=10).status_code == 200
    finally:
        mock.stop()
