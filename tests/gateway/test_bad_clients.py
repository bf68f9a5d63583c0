"""The bad-client catalogue: what careless or hostile clients send, on every surface.

One mock backend and one Nexus (Daphne) serve the module. Each case sends one
kind of bad request to every endpoint (OpenAI's chat, completions, embeddings
and responses, Anthropic's messages, Ollama's chat, generate and embed) and
asserts: no 500 of Nexus's own, an
error in the surface's shape with a 4xx
status (or the backend's own answer when the request was valid enough to
forward), in-flight back to 0, and usage still recorded afterwards (a request
whose strings the database cannot store must not jam the usage writer).
Huge bodies and slow clients are in tests/test_daphne_limits.py.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    start_mock_backend,
    start_nexus_server,
)
from usage.models import ApiKey, UsageRecord
from usage.stream import drain_usage_stream

MODEL = "llama3:8b"
MAX_BODY = 2 * 1024 * 1024
ENDPOINTS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 5}),
    "embeddings": ("/v1/embeddings", {"input": "hi"}),
    "messages": (
        "/v1/messages",
        {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    ),
    "responses": ("/v1/responses", {"input": "hi"}),
    "ollama-chat": (
        "/api/chat",
        {"messages": [{"role": "user", "content": "hi"}], "stream": False},
    ),
    "ollama-generate": ("/api/generate", {"prompt": "hi", "stream": False}),
    "ollama-embed": ("/api/embed", {"input": "hi"}),
}
BAD = "a\x00b\ud800c"  # a NUL byte and a lone surrogate
_blocker: Any = None


@dataclass
class Setup:
    nexus: NexusServer
    mock: MockBackendProcess
    key: str
    admin_token: str

    def post(
        self, path: str, *, content: bytes, request_id: str | None = None
    ) -> httpx.Response:
        headers = {
            "authorization": f"Bearer {self.key}",
            "content-type": "application/json",
            "x-request-id": request_id or uuid.uuid4().hex,
        }
        return httpx.post(
            f"{self.nexus.base_url}{path}", content=content, headers=headers, timeout=30
        )

    def in_flight(self) -> int:
        record = httpx.post(
            f"{self.nexus.base_url}/api/v1/route/explain",
            json={"model": MODEL},
            headers={"Authorization": f"Token {self.admin_token}"},
            timeout=5,
        ).json()
        return sum(c["in_flight"] for c in record["candidates"])


@pytest.fixture(scope="module")
def setup(django_db_setup: None, django_db_blocker) -> Iterator[Setup]:
    global _blocker
    _blocker = django_db_blocker
    mock = start_mock_backend("--models", MODEL, "--name", "mock-bad-clients")
    try:
        with django_db_blocker.unblock():
            backend = Backend.objects.create(
                name="mock-bad-clients",
                base_url=mock.base_url,
                status=HealthStatus.HEALTHY,
            )
            BackendModel.objects.create(backend=backend, name=MODEL)
            _, key = ApiKey.objects.create_key("bad-clients")
            staff = get_user_model().objects.create_user(
                "bad-clients-ops", is_staff=True, is_superuser=True
            )
            token = Token.objects.create(user=staff).key
        nexus = start_nexus_server(
            NEXUS_MAX_BODY_BYTES=str(MAX_BODY),
            NEXUS_BREAKER_FAILURES="1000000",
            NEXUS_USAGE_FLUSH_INTERVAL="0.1",
            NEXUS_USAGE_SHIP_INTERVAL="0.01",
        )
    except BaseException:
        mock.stop()  # set up half-way: leave no process behind
        raise
    try:
        yield Setup(nexus, mock, key, token)
    finally:
        nexus.stop()
        mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def _check(response: httpx.Response) -> None:
    """No 500 of our own; any error is in OpenAI's shape.

    A 500 relayed from the backend (the mock chokes on some of these inputs
    itself) carries X-Nexus-Backend and is the backend's OpenAI-shaped error.
    """
    relayed = "x-nexus-backend" in response.headers
    assert (
        response.status_code < 500
        or relayed
        or response.status_code
        in (
            502,
            503,
            504,
        )
    ), (response.status_code, response.text[:300])
    if response.status_code >= 400:
        payload = response.json()
        error = payload["error"]
        if response.url.path == "/v1/messages":  # Anthropic's shape
            assert payload["type"] == "error"
            assert set(error) >= {"type", "message"}
            assert isinstance(error["message"], str)
        elif response.url.path.startswith("/api/"):  # Ollama's: a string
            assert isinstance(error, str) and error
        else:
            assert set(error) >= {"message", "type", "param", "code"}
            assert isinstance(error["message"], str)


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


def _still_serving(setup: Setup) -> None:
    """In flight back to 0, and a good request is served and billed."""
    deadline = time.monotonic() + 10
    while setup.in_flight():
        assert time.monotonic() < deadline, "in-flight count did not return to 0"
        time.sleep(0.05)
    request_id = f"after-{uuid.uuid4().hex[:12]}"
    path, fields = ENDPOINTS["chat"]
    response = setup.post(
        path,
        content=json.dumps({"model": MODEL, **fields}).encode(),
        request_id=request_id,
    )
    assert response.status_code == 200
    assert _usage_of(request_id).status == 200


def _wrong_type_bodies(fields: dict[str, Any]) -> Iterator[dict[str, Any]]:
    body = {"model": MODEL, **fields, "stream": False, "n": 1, "max_tokens": 5}
    for name in body:
        for value in (None, 123, -1.5, "text", [], [1, [2]], {}, {"a": None}, True):
            yield {**body, name: value}


def _with_bad_strings(value: Any) -> Any:
    """`value` with every string (values, not keys) replaced by BAD."""
    if isinstance(value, str):
        return BAD
    if isinstance(value, list):
        return [_with_bad_strings(item) for item in value]
    if isinstance(value, dict):
        return {key: _with_bad_strings(item) for key, item in value.items()}
    return value


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_the_backend_is_configured(setup: Setup) -> None:
    assert Backend.objects.filter(name="mock-bad-clients").exists()


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_invalid_json_is_a_400(setup: Setup, endpoint: str) -> None:
    path, _ = ENDPOINTS[endpoint]
    for content in (
        b"{not json",
        b"",
        b"\xff\xfe",
        b"[1, 2",
        b'"just a string"',
        b"null",
    ):
        response = setup.post(path, content=content)
        assert response.status_code == 400, (content, response.text)
        _check(response)
    _still_serving(setup)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_deeply_nested_json_is_not_a_500(setup: Setup, endpoint: str) -> None:
    path, fields = ENDPOINTS[endpoint]
    for depth in (100, 100_000):
        nested = json.loads(_nested(100)) if depth == 100 else None
        if nested is not None:
            body = json.dumps({"model": MODEL, **fields, "user_data": nested})
        else:  # too deep for any JSON parser with a stack: must be a clean 400
            body = '{"model": "' + MODEL + '", "x": ' + _nested(depth) + "}"
        response = setup.post(path, content=body.encode())
        _check(response)
        if depth == 100_000:
            assert response.status_code == 400
    _still_serving(setup)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_nul_bytes_and_lone_surrogates_in_every_string(
    setup: Setup, endpoint: str
) -> None:
    path, fields = ENDPOINTS[endpoint]
    request_ids = []
    bodies = [
        {"model": BAD, **fields},  # an unknown model, with that name billed
        {"model": MODEL, **_with_bad_strings(fields)},
        {"model": MODEL, **fields, "user": BAD, "stop": [BAD]},
    ]
    for body in bodies:
        request_id = uuid.uuid4().hex
        request_ids.append(request_id)
        # json.dumps escapes both (\u0000, \ud800): valid JSON text.
        response = setup.post(
            path, content=json.dumps(body).encode(), request_id=request_id
        )
        _check(response)
    _still_serving(setup)
    for request_id in request_ids:  # each counted, whatever its strings held
        _usage_of(request_id)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_wrong_types_for_every_field(setup: Setup, endpoint: str) -> None:
    path, fields = ENDPOINTS[endpoint]
    for body in _wrong_type_bodies(fields):
        response = setup.post(path, content=json.dumps(body).encode())
        _check(response)
    _still_serving(setup)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_out_of_range_numbers(setup: Setup, endpoint: str) -> None:
    path, fields = ENDPOINTS[endpoint]
    for name in ("n", "max_tokens", "temperature", "top_p", "dimensions"):
        for value in (-1, 0, 10**30, -(10**30), 1e308, 1.5):
            body = {"model": MODEL, **fields, name: value}
            response = setup.post(path, content=json.dumps(body).encode())
            _check(response)
    _still_serving(setup)


def test_ten_thousand_messages(setup: Setup) -> None:
    path, _ = ENDPOINTS["chat"]
    messages = [{"role": "user", "content": f"message {i}"} for i in range(10_000)]
    response = setup.post(
        path, content=json.dumps({"model": MODEL, "messages": messages}).encode()
    )
    _check(response)
    assert response.status_code == 200
    _still_serving(setup)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_body_over_the_limit_is_a_413(setup: Setup, endpoint: str) -> None:
    path, fields = ENDPOINTS[endpoint]
    body = json.dumps({"model": MODEL, **fields, "pad": "x" * MAX_BODY}).encode()
    response = setup.post(path, content=body)
    assert response.status_code == 413
    _check(response)
    _still_serving(setup)


@pytest.mark.parametrize(
    ("path", "meant", "shape"),
    [
        ("//v1/chat/completions", "/v1/chat/completions", "openai"),
        ("/v1/chat/completions/", "/v1/chat/completions", "openai"),
        ("/chat/completions", "/v1/chat/completions", "openai"),  # base URL w/o /v1
        ("/embeddings", "/v1/embeddings", "openai"),
        ("/api/chat/", "/api/chat", "ollama"),
        ("//api/generate", "/api/generate", "ollama"),
    ],
)
def test_a_near_miss_path_is_a_404_that_names_the_path_meant(
    setup: Setup, path: str, meant: str, shape: str
) -> None:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    response = setup.post(path, content=body)

    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    if shape == "ollama":
        assert set(payload) == {"error"}
        message = payload["error"]
    else:
        assert payload["error"]["code"] == "unknown_url"
        message = payload["error"]["message"]
    assert f"Did you mean {meant}?" in message
