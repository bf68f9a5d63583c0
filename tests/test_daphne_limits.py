"""Daphne refuses and times out clients before the application reads their body.

Raw sockets against a Daphne process serving Nexus: an upload is answered from
its head alone (401 without a key, 413 over the limit) while not one byte of
its body was sent, a chunked body is cut at the limit, and a client dripping
its head or body gets a 408.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.core.management import call_command

from tests.conftest import (
    HEAD_OF_MEGABYTES,
    NexusServer,
    send_a_head_of_megabytes,
    start_nexus_server,
    wait_until,
)
from usage.models import ApiKey, UsageRecord
from usage.stream import drain_usage_stream

MAX_BODY = 100_000
PATH = "/v1/chat/completions"


@dataclass
class Server:
    nexus: NexusServer
    key: str

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.nexus.base_url.removeprefix("http://").split(":")
        return host, int(port)

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=10)
        return sock


_blocker: Any = None


@pytest.fixture(scope="module")
def server(django_db_setup: None, django_db_blocker) -> Iterator[Server]:
    global _blocker
    _blocker = django_db_blocker
    with django_db_blocker.unblock():
        _, key = ApiKey.objects.create_key("limits")
    nexus = start_nexus_server(
        NEXUS_MAX_BODY_BYTES=str(MAX_BODY),
        NEXUS_CLIENT_HEADER_TIMEOUT="1",
        NEXUS_CLIENT_BODY_TIMEOUT="1",
        NEXUS_USAGE_FLUSH_INTERVAL="0.1",
        NEXUS_USAGE_SHIP_INTERVAL="0.01",
    )
    try:
        # Load the gateway's configuration (keys) before the first upload.
        models = httpx.get(
            f"{nexus.base_url}/v1/models",
            headers={"authorization": f"Bearer {key}"},
            timeout=10,
        )
        assert models.status_code == 200
        yield Server(nexus, key)
    finally:
        nexus.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def _usage_of(request_id: str) -> UsageRecord:
    deadline = time.monotonic() + 15
    while True:
        with _blocker.unblock():
            if settings.NEXUS_USAGE_TRANSPORT == "redis":
                drain_usage_stream()
            record = UsageRecord.objects.filter(request_id=request_id).first()
        if record is not None:
            return record
        assert time.monotonic() < deadline, f"no usage recorded for {request_id}"
        time.sleep(0.05)


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one response until the server closes the connection."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return status, headers, body


def _head(length: str | None, key: str | None = None, extra: str = "") -> bytes:
    lines = [
        f"POST {PATH} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
    ]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_the_server_knows_the_key(server: Server) -> None:
    assert ApiKey.objects.filter(name="limits").exists()


def test_a_gigabyte_upload_without_a_key_is_refused_at_the_headers(
    server: Server,
) -> None:
    with server.connect() as sock:
        # ... and not one byte of the body.
        sock.sendall(_head(str(1024**3), extra="X-Request-ID: early-401\r\n"))
        status, headers, body = _read_response(sock)
    assert status == 401
    assert headers["connection"] == "close"
    assert headers["x-request-id"] == "early-401"
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    # Counted like any refusal: a request and an error, with no tokens.
    record = _usage_of("early-401")
    assert (record.status, record.total_tokens, record.backend) == (401, 0, "")


def test_an_anthropic_upload_is_refused_in_anthropic_shape(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(
            _head(str(1024**3), extra="x-api-key: nx-wrong\r\n").replace(
                PATH.encode(), b"/v1/messages"
            )
        )
        status, _, body = _read_response(sock)
    assert status == 401
    payload = json.loads(body)
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "authentication_error"


def test_an_anthropic_key_in_x_api_key_passes_the_head(server: Server) -> None:
    response = httpx.post(
        f"{server.nexus.base_url}/v1/messages",
        headers={"x-api-key": server.key, "anthropic-version": "2023-06-01"},
        json={
            "model": "no-such-model",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "x"}],
        },
        timeout=10,
    )
    assert response.status_code == 404  # past the head: the proxy answers


def test_a_wrong_key_is_refused_at_the_headers(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(_head("50000", key="nx-not-a-key"))
        status, _, body = _read_response(sock)
    assert status == 401
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


def test_a_length_over_the_limit_is_refused_at_the_headers(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(_head(str(MAX_BODY + 1), key=server.key, extra=""))
        status, _, body = _read_response(sock)
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_expect_continue_gets_the_refusal_instead_of_continue(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(_head(str(1024**3), extra="Expect: 100-continue\r\n"))
        status, _, body = _read_response(sock)
    assert status == 401
    assert b"100 Continue" not in body


def test_a_chunked_body_is_cut_at_the_limit(server: Server) -> None:
    chunk = b"x" * 30_000
    with server.connect() as sock:
        sock.sendall(
            _head(None, key=server.key, extra="Transfer-Encoding: chunked\r\n")
        )
        sent = 0
        try:
            while sent <= MAX_BODY * 2:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _, body = _read_response(sock)
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"


def _spooled_bytes(pid: int) -> int:
    """Bytes in the server's open temporary files (unlinked: "(deleted)")."""
    total = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd).endswith("(deleted)"):
                total += fd.stat().st_size
    return total


def test_a_chunked_body_is_spooled_to_disk_and_freed_at_the_cut(
    server: Server,
) -> None:
    # Before the limit, what arrived is on disk (a temporary file), not in
    # memory; at the cut the file is closed.
    pid = server.nexus.process.pid
    chunk = b"x" * 20_000
    with server.connect() as sock:
        sock.sendall(
            _head(None, key=server.key, extra="Transfer-Encoding: chunked\r\n")
        )
        for _ in range(4):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        wait_until(
            lambda: _spooled_bytes(pid) >= 80_000, what="the body spooled to disk"
        )
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(2):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, _, _ = _read_response(sock)
    assert status == 413
    wait_until(lambda: _spooled_bytes(pid) == 0, what="the spooled body freed")


def test_a_client_dripping_its_head_gets_a_408(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(f"POST {PATH} HTTP/1.1\r\nHost: 127".encode())
        status, _, body = _read_response(sock)  # the server's deadline ends it
    assert status == 408
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_client_dripping_its_body_gets_a_408(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(_head("1000", key=server.key) + b'{"model": ')
        status, _, body = _read_response(sock)
    assert status == 408
    assert "body" in json.loads(body)["error"]["message"]


def test_an_idle_kept_alive_connection_is_closed_quietly(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    # One answer, then the connection closed by the deadline with nothing more.
    assert data.count(b"HTTP/1.1 ") == 1
    assert data.startswith(b"HTTP/1.1 200")


def test_an_upload_within_the_limits_is_served(server: Server) -> None:
    response = httpx.post(
        f"{server.nexus.base_url}{PATH}",
        headers={"authorization": f"Bearer {server.key}"},
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
        timeout=10,
    )
    # Past the head checks: the proxy itself answers (no backend has the model).
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_a_head_of_megabytes_is_refused_not_held(server: Server) -> None:
    with server.connect() as sock:
        sent, data = send_a_head_of_megabytes(sock, PATH)
    # Twisted stops reading past 16 KiB of headers (a 400) and hangs up.
    assert sent < HEAD_OF_MEGABYTES or data.startswith(b"HTTP/1.1 4")


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/messages", "anthropic"), ("/api/chat", "ollama"), (PATH, "openai")],
)
def test_a_bare_cr_in_a_header_is_a_400_in_its_surfaces_shape(
    server: Server, path: str, shape: str
) -> None:
    # Twisted refuses the header (RFC 9110) with a bare status line and no
    # body; an SDK would show an empty error.
    with server.connect() as sock:
        sock.sendall(
            _head("2", key=server.key, extra="X-Odd: a\rb\r\n").replace(
                PATH.encode(), path.encode()
            )
            + b"{}"
        )
        status, headers, body = _read_response(sock)
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    payload = json.loads(body)
    if shape == "anthropic":
        assert payload["type"] == "error"
        message = payload["error"]["message"]
    elif shape == "ollama":
        message = payload["error"]
    else:
        assert payload["error"]["code"] == "malformed_request"
        message = payload["error"]["message"]
    assert "not valid HTTP/1.1" in message
    assert "bare CR" in message


@pytest.mark.parametrize("how", ["one-line", "many-lines"])
def test_headers_over_twisteds_limit_are_a_431_that_says_so(
    server: Server, how: str
) -> None:
    if how == "one-line":
        extra = "X-Big: " + "y" * 20_000 + "\r\n"
    else:
        extra = "".join(f"X-Big-{n}: {'y' * 1000}\r\n" for n in range(20))
    with server.connect() as sock:
        sock.sendall(_head("2", extra=extra) + b"{}")
        status, _, body = _read_response(sock)
    assert status == 431
    error = json.loads(body)["error"]
    assert error["code"] == "request_headers_too_large"
    assert "16 KiB" in error["message"]


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/messages", "anthropic"), ("/api/chat", "ollama"), (PATH, "openai")],
)
@pytest.mark.parametrize("how", ["length", "chunked"])
def test_an_oversized_body_is_refused_in_its_surfaces_shape(
    server: Server, path: str, shape: str, how: str
) -> None:
    headers = "x-api-key: " + server.key + "\r\n" if shape == "anthropic" else ""
    with server.connect() as sock:
        if how == "length":
            sock.sendall(
                _head(str(MAX_BODY + 1), key=server.key).replace(
                    PATH.encode(), path.encode()
                )
            )
        else:
            sock.sendall(
                _head(
                    None,
                    key=server.key,
                    extra=headers + "Transfer-Encoding: chunked\r\n",
                ).replace(PATH.encode(), path.encode())
            )
            chunk = b"x" * 30_000
            try:
                for _ in range(2 * MAX_BODY // len(chunk) + 1):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                pass
        status, _, body = _read_response(sock)
    assert status == 413
    payload = json.loads(body)
    if shape == "anthropic":
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "request_too_large"
    elif shape == "ollama":
        assert set(payload) == {"error"} and isinstance(payload["error"], str)
    else:
        assert payload["error"]["code"] == "request_too_large"
