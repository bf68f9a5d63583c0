"""The fault catalogue: a hostile backend, one broken behaviour per model name.

One hostile backend process (tests.hostile_backend) and one Nexus
(Daphne) serve the module; each case asks for the model that names its fault,
plain or streamed. Every case asserts what a client must see: no 500 of
Nexus's own, an error in OpenAI's shape (a JSON error, or a stream's error
event), nothing of the upstream page, the backend's in-flight count back to
0, and the request's usage recorded.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from rest_framework.authtoken.models import Token

from backends.models import Backend, BackendModel, HealthStatus
from nexus_mock import MockBackendProcess, spawn_mock_backend
from routing.models import RoutingPolicy
from tests.conftest import NexusServer, start_nexus_server
from tests.hostile_backend import MODES, SECRET
from usage.models import ApiKey, UsageRecord
from usage.stream import drain_usage_stream

MAX_REPLY = 1024 * 1024
MAX_EVENT = 64 * 1024
MAX_UNSENT = 256 * 1024
HUGE = 64 * 1024 * 1024  # what the hostile backend sends as a huge body
BACKEND = "hostile"


@dataclass
class Setup:
    nexus: NexusServer
    hostile: MockBackendProcess
    key: str
    admin_token: str

    def ask(self, mode: str, stream: bool) -> tuple[httpx.Response, str]:
        request_id = f"hostile-{uuid.uuid4().hex[:12]}"
        body = {
            "model": f"hostile-{mode}",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": stream,
        }
        response = httpx.post(
            f"{self.nexus.base_url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {self.key}", "x-request-id": request_id},
            timeout=30,
        )
        return response, request_id

    def in_flight(self) -> int:
        record = httpx.post(
            f"{self.nexus.base_url}/api/v1/route/explain",
            json={"model": "hostile-ok"},
            headers={"Authorization": f"Token {self.admin_token}"},
            timeout=5,
        ).json()
        return sum(c["in_flight"] for c in record["candidates"])


_blocker: Any = None


@pytest.fixture(scope="module")
def setup(django_db_setup: None, django_db_blocker) -> Iterator[Setup]:
    # Usage rows are read outside any test transaction (autocommit), so that
    # each poll sees what the server committed meanwhile, on SQLite too.
    global _blocker
    _blocker = django_db_blocker
    hostile = spawn_mock_backend("--size", str(HUGE), module="tests.hostile_backend")
    try:
        with django_db_blocker.unblock():
            backend = Backend.objects.create(
                name=BACKEND,
                base_url=hostile.base_url,
                status=HealthStatus.HEALTHY,
                request_timeout=1.0,  # the hanging and dripping modes
            )
            for mode in MODES:
                BackendModel.objects.create(backend=backend, name=f"hostile-{mode}")
            policy = RoutingPolicy.load()
            policy.max_retries = 0
            policy.save()
            _, key = ApiKey.objects.create_key("hostile-tests")
            staff = get_user_model().objects.create_user(
                "hostile-ops", is_staff=True, is_superuser=True
            )
            token = Token.objects.create(user=staff).key
        nexus = start_nexus_server(
            NEXUS_UPSTREAM_MAX_REPLY_BYTES=str(MAX_REPLY),
            NEXUS_UPSTREAM_MAX_EVENT_BYTES=str(MAX_EVENT),
            NEXUS_STREAM_MAX_UNSENT_BYTES=str(MAX_UNSENT),
            # Every case fails the same backend on purpose: keep it in service.
            NEXUS_BREAKER_FAILURES="1000000",
            NEXUS_BREAKER_PERSIST="0",
            NEXUS_USAGE_FLUSH_INTERVAL="0.1",
            NEXUS_USAGE_SHIP_INTERVAL="0.01",
        )
    except BaseException:
        hostile.stop()  # set up half-way: leave no process behind
        raise
    try:
        yield Setup(nexus, hostile, key, token)
    finally:
        nexus.stop()
        hostile.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def _usage_of(request_id: str) -> UsageRecord:
    """Wait for the request's usage row (written about once a second)."""
    deadline = time.monotonic() + 15
    while True:
        with _blocker.unblock():
            if settings.NEXUS_USAGE_TRANSPORT == "redis":
                drain_usage_stream()
            record = UsageRecord.objects.filter(request_id=request_id).first()
        if record is not None:
            return record
        assert time.monotonic() < deadline, f"no usage recorded for {request_id}"
        time.sleep(0.1)


def _wait_idle(setup: Setup) -> None:
    deadline = time.monotonic() + 10
    while setup.in_flight():
        assert time.monotonic() < deadline, "in-flight count did not return to 0"
        time.sleep(0.05)


def _openai_error(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def _stream_events(text: str) -> list[dict | str]:
    events: list[dict | str] = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = [
            line[5:].strip() for line in block.splitlines() if line.startswith("data:")
        ]
        if not data:
            continue
        joined = "\n".join(data)
        try:
            events.append(json.loads(joined))
        except ValueError:
            events.append(joined)
    return events


@pytest.mark.django_db  # also makes pytest-django create the test database
def test_the_hostile_backend_serves_every_mode(setup: Setup) -> None:
    assert BackendModel.objects.filter(backend__name=BACKEND).count() == len(MODES)


# (mode, stream) -> (status, error code); None: a success to check separately.
REFUSED = {
    ("non-json-200", False): (502, "upstream_invalid_response"),
    ("non-json-200", True): (502, "upstream_invalid_response"),
    ("html-500", False): (500, "upstream_error"),
    ("html-500", True): (500, "upstream_error"),
    ("json-error", False): (400, "context_length_exceeded"),
    ("json-error", True): (400, "context_length_exceeded"),
    ("huge-body", False): (502, "upstream_reply_too_large"),
    ("endless-event", True): (502, "upstream_event_too_large"),
    ("die-mid-reply", False): (502, "upstream_unavailable"),
    ("hang", False): (504, "upstream_timeout"),
    ("hang", True): (504, "upstream_timeout"),
    ("drip", False): (504, "upstream_timeout"),
    ("drip", True): (504, "upstream_timeout"),
    ("wrong-type", False): (502, "upstream_invalid_response"),
    ("wrong-type", True): (502, "upstream_invalid_response"),
    ("bad-utf8", False): (502, "upstream_invalid_response"),
    ("bad-utf8", True): (502, "upstream_invalid_response"),
    ("bad-later", False): (502, "upstream_invalid_response"),
    ("huge-headers", False): (502, "upstream_unavailable"),
    ("huge-headers", True): (502, "upstream_unavailable"),
    ("lying-length", False): (502, "upstream_unavailable"),
    ("lying-length", True): (502, "upstream_unavailable"),
}


@pytest.mark.parametrize(
    ("mode", "stream", "status", "code"),
    [(mode, stream, *outcome) for (mode, stream), outcome in REFUSED.items()],
    ids=[f"{mode}-{'stream' if stream else 'plain'}" for mode, stream in REFUSED],
)
def test_a_broken_reply_becomes_an_error_of_the_gateway(
    setup: Setup, mode: str, stream: bool, status: int, code: str
) -> None:
    response, request_id = setup.ask(mode, stream)
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    error = _openai_error(response.content)
    assert error["code"] == code
    assert SECRET not in response.text and "/srv/internal" not in response.text
    if status == 500:  # the backend's status, carried in an error of our own
        assert BACKEND in error["message"] and request_id in error["message"]
    _wait_idle(setup)
    record = _usage_of(request_id)
    assert record.status == status
    assert record.is_error


def test_a_stream_that_dies_after_its_first_event_ends_with_an_error_event(
    setup: Setup,
) -> None:
    response, request_id = setup.ask("die-mid-reply", True)
    assert response.status_code == 200
    events = _stream_events(response.text)
    assert events[0]["choices"][0]["delta"]["content"] == "first "
    assert events[-1]["error"]["code"] == "upstream_stream_broken"
    _wait_idle(setup)
    assert _usage_of(request_id).error == "upstream_stream_broken"


def test_a_later_event_that_is_not_json_ends_the_stream_with_an_error_event(
    setup: Setup,
) -> None:
    # The first event is valid and relayed; the second is not JSON, and valid
    # events follow it for ever: the client gets what came before, then the
    # error event, and the stream ends (the backend's connection is closed).
    response, request_id = setup.ask("bad-later", True)
    assert response.status_code == 200
    events = _stream_events(response.text)
    assert events[0]["choices"][0]["delta"]["content"] == "fine "
    assert "{broken" not in events and "{broken" not in response.text
    assert events[-1]["error"]["code"] == "upstream_invalid_response"
    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert len(events) == 2
    _wait_idle(setup)
    record = _usage_of(request_id)
    assert record.status == 200
    assert record.error == "upstream_invalid_response"
    assert record.is_error


def test_an_sdk_reading_a_stream_with_a_later_invalid_event_gets_an_error(
    setup: Setup,
) -> None:
    # What the OpenAI SDK makes of it: the first chunk, then an APIError
    # carrying the gateway's message (not a JSON decoding crash).
    client = openai.OpenAI(
        base_url=f"{setup.nexus.base_url}/v1", api_key=setup.key, max_retries=0
    )
    stream = client.chat.completions.create(
        model="hostile-bad-later",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
    )
    texts = []
    with pytest.raises(openai.APIError, match="not a JSON object"):
        for chunk in stream:
            texts.append(chunk.choices[0].delta.content)
    assert texts == ["fine "]
    _wait_idle(setup)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_absurd_token_counts_are_clamped_not_fatal(setup: Setup, stream: bool) -> None:
    response, request_id = setup.ask("huge-usage", stream)
    assert response.status_code == 200
    _wait_idle(setup)
    record = _usage_of(request_id)
    assert record.prompt_tokens == 10**12
    assert record.completion_tokens == 0
    assert not record.estimated


def test_a_huge_reply_is_cut_at_the_limit_not_held(setup: Setup) -> None:
    pid = setup.nexus.process.pid
    before = _peak_rss(pid)
    for _ in range(3):
        response, _ = setup.ask("huge-body", False)
        assert response.status_code == 502
    # 64 MiB replies read whole would raise the peak by at least that much.
    assert _peak_rss(pid) - before < 16 * 1024 * 1024
    _wait_idle(setup)


def test_the_backend_answers_normally_between_faults(setup: Setup) -> None:
    response, request_id = setup.ask("ok", False)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "hello from hostile"
    streamed, _ = setup.ask("ok", True)
    assert _stream_events(streamed.text)[-1] == "[DONE]"
    assert _usage_of(request_id).total_tokens == 7


def test_a_client_that_stops_reading_a_stream_is_cut_off(setup: Setup) -> None:
    # The backend streams valid events for ever; the client reads the head and
    # then nothing. Without the cut this request would never end.
    request_id = f"stall-{uuid.uuid4().hex[:12]}"
    body = json.dumps(
        {
            "model": "hostile-flood",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
        }
    ).encode()
    host, port = setup.nexus.base_url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            + f"Authorization: Bearer {setup.key}\r\nX-Request-ID: {request_id}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Read nothing: the usage record says the answer began (200) and was
        # cut for the stalled reader.
        record = _usage_of(request_id)
        assert record.error == "client_stalled"
        assert record.status == 200
        _wait_idle(setup)
        # The server closed the connection (a reset: what the client left
        # unread is dropped), rather than holding those bytes while it idles.
        sock.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(65536):
                pass


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


# The same faults reach Anthropic and Ollama clients through translation.
OTHER_SURFACES = {
    "messages": ("/v1/messages", {"max_tokens": 20}),
    "ollama-chat": ("/api/chat", {}),
}
LEG_FAULTS = [
    ("non-json-200", False, 502),
    ("non-json-200", True, 502),
    ("html-500", False, 500),
    ("huge-body", False, 502),
    ("endless-event", True, 502),
    ("wrong-type", True, 502),
    ("bad-utf8", False, 502),
    ("hang", False, 504),
]


@pytest.mark.parametrize("surface", list(OTHER_SURFACES))
@pytest.mark.parametrize(
    ("mode", "stream", "status"),
    LEG_FAULTS,
    ids=[f"{m}-{'stream' if s else 'plain'}" for m, s, _ in LEG_FAULTS],
)
def test_faults_reach_other_surfaces_in_their_error_shape(
    setup: Setup, surface: str, mode: str, stream: bool, status: int
) -> None:
    path, extra = OTHER_SURFACES[surface]
    request_id = f"leg-{uuid.uuid4().hex[:12]}"
    response = httpx.post(
        f"{setup.nexus.base_url}{path}",
        json={
            "model": f"hostile-{mode}",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": stream,
            **extra,
        },
        headers={"authorization": f"Bearer {setup.key}", "x-request-id": request_id},
        timeout=30,
    )
    assert response.status_code == status, response.text[:300]
    assert SECRET not in response.text and "/srv/internal" not in response.text
    payload = response.json()
    if surface == "messages":
        assert payload["type"] == "error" and payload["error"]["message"]
    else:
        assert isinstance(payload["error"], str) and payload["error"]
    _wait_idle(setup)
    assert _usage_of(request_id).status == status
