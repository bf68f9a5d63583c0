"""The mock backend, as a real process driven by the official openai SDK."""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import json
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from django.core.management import CommandError, call_command

from nexus_mock import (
    MockBackendProcess,
    MockStartError,
    spawn_mock_backend,
)
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.mode_independent

MODELS = ["llama3:8b", "mistral:7b"]


@dataclass
class Mock:
    """A running mock backend plus clients for it (plain HTTP: no TLS set-up)."""

    process: MockBackendProcess
    http: httpx.Client

    @property
    def base_url(self) -> str:
        return self.process.base_url

    @property
    def port(self) -> int:
        return self.process.port

    def configure(self, **knobs: Any) -> dict[str, Any]:
        response = self.http.post("/_mock/config", json=knobs)
        assert response.status_code == 200, response.text
        config: dict[str, Any] = response.json()
        return config

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.http.get("/_mock/stats").json()
        return stats

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key,
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=False, timeout=10),
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(verify=False, timeout=10),
        )


def control(process: MockBackendProcess) -> Mock:
    return Mock(process, httpx.Client(base_url=process.base_url, verify=False))


@pytest.fixture(scope="module")
def shared_mock() -> Iterator[Mock]:
    """One process for the module; tests change knobs at runtime instead."""
    process = spawn_mock_backend(
        "--models", ",".join(MODELS), "--name", "mock-a", "--seed", "7"
    )
    mock = control(process)
    yield mock
    mock.http.close()
    process.stop()


@pytest.fixture
def mock(shared_mock: Mock) -> Mock:
    """The shared mock, back to its start-up configuration with zeroed stats."""
    response = shared_mock.http.post("/_mock/reset")
    assert response.status_code == 200, response.text
    return shared_mock


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_lists_and_retrieves_configured_models(mock: Mock) -> None:
    client = mock.client()

    assert [model.id for model in client.models.list()] == MODELS
    model = client.models.retrieve("mistral:7b")
    assert (model.id, model.owned_by) == ("mistral:7b", "mock-a")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"


def test_chat_echoes_backend_model_and_last_user_message(
    mock: Mock,
) -> None:
    raw = mock.client().chat.completions.with_raw_response.create(
        model="mistral:7b",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is"},
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                    {"type": "text", "text": "in this picture?"},
                ],
            },
        ],
        extra_headers={"X-Request-ID": "req-42"},
    )
    completion = raw.parse()

    reply = "[mock-a/mistral:7b] echo: what is in this picture?"
    assert completion.choices[0].message.content == reply
    assert completion.choices[0].finish_reason == "stop"
    assert completion.model == "mistral:7b"
    assert completion.usage is not None
    # 3 + 2 + 2 + 5 words in the messages; 7 words in the reply.
    assert completion.usage.prompt_tokens == 12
    assert completion.usage.completion_tokens == 7
    assert completion.usage.total_tokens == 19
    assert raw.headers["x-mock-backend"] == "mock-a"
    assert raw.headers["x-mock-request-id"] == "req-42"


def test_n_and_max_tokens_shape_the_choices(mock: Mock) -> None:
    completion = mock.client().chat.completions.create(
        model="llama3:8b",
        messages=[{"role": "user", "content": "one two three four"}],
        n=2,
        max_tokens=3,
    )

    assert [choice.message.content for choice in completion.choices] == [
        "[mock-a/llama3:8b] echo: one"
    ] * 2
    assert [choice.finish_reason for choice in completion.choices] == ["length"] * 2
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 6


async def test_chat_stream_joins_to_the_non_stream_reply(
    mock: Mock,
) -> None:
    client = mock.async_client()
    messages: Any = [{"role": "user", "content": "stream me a short story"}]
    whole = await client.chat.completions.create(model="llama3:8b", messages=messages)

    stream = await client.chat.completions.create(
        model="llama3:8b", messages=messages, stream=True
    )
    chunks = [chunk async for chunk in stream]

    assert len(chunks) == 4
    assert all(chunk.usage is None and len(chunk.choices) == 1 for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [chunk.choices[0].finish_reason for chunk in chunks] == [
        None,
        None,
        None,
        "stop",
    ]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == whole.choices[0].message.content

    mock.configure(chunks=7)
    stream = await client.chat.completions.create(
        model="llama3:8b",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]

    usage_chunks = [chunk for chunk in chunks if chunk.usage is not None]
    assert len(usage_chunks) == 1
    assert usage_chunks[0] is chunks[-1]
    assert usage_chunks[0].choices == []
    assert usage_chunks[0].usage == whole.usage
    content_chunks = chunks[:-1]
    assert len(content_chunks) == 7
    text = "".join(chunk.choices[0].delta.content or "" for chunk in content_chunks)
    assert text == whole.choices[0].message.content


def test_stream_is_server_sent_events_ending_with_done(
    mock: Mock,
) -> None:
    body = {
        "model": "llama3:8b",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    response = mock.http.post("/v1/chat/completions", json=body)

    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])


async def test_completions_echo_each_prompt(mock: Mock) -> None:
    client = mock.async_client()

    single = await client.completions.create(model="llama3:8b", prompt="Once upon")
    assert single.choices[0].text == "[mock-a/llama3:8b] echo: Once upon"
    assert single.usage is not None
    assert (single.usage.prompt_tokens, single.usage.completion_tokens) == (2, 4)

    many = await client.completions.create(
        model="mistral:7b", prompt=["alpha", "beta gamma"]
    )
    assert [choice.text for choice in many.choices] == [
        "[mock-a/mistral:7b] echo: alpha",
        "[mock-a/mistral:7b] echo: beta gamma",
    ]
    assert many.usage is not None
    assert many.usage.total_tokens == 3 + 3 + 4

    stream = await client.completions.create(
        model="llama3:8b",
        prompt="Once upon",
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks[:-1]) == single.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert (chunks[-1].choices, chunks[-1].usage) == ([], single.usage)


def test_embeddings_are_deterministic_per_text(mock: Mock) -> None:
    client = mock.client()

    # The SDK asks for base64 unless told otherwise.
    first = client.embeddings.create(model="llama3:8b", input=["hello", "world"])
    again = client.embeddings.create(
        model="llama3:8b", input="hello", encoding_format="float"
    )

    vectors = [item.embedding for item in first.data]
    assert [len(vector) for vector in vectors] == [8, 8]
    assert vectors[0] != vectors[1]
    assert again.data[0].embedding == vectors[0]
    assert sum(value * value for value in vectors[0]) == pytest.approx(1.0, abs=1e-5)
    assert (first.usage.prompt_tokens, first.usage.total_tokens) == (2, 2)

    mock.configure(embedding_dim=5)
    assert (
        len(client.embeddings.create(model="llama3:8b", input="x").data[0].embedding)
        == 5
    )


def test_embeddings_base64_is_little_endian_float32(mock: Mock) -> None:
    def embed(encoding: str) -> Any:
        body = {"model": "llama3:8b", "input": "hello", "encoding_format": encoding}
        response = mock.http.post("/v1/embeddings", json=body)
        return response.json()["data"][0]["embedding"]

    packed = base64.b64decode(embed("base64"))
    assert list(struct.unpack("<8f", packed)) == embed("float")


def test_unknown_model_is_not_found(mock: Mock) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        mock.client().chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )

    assert caught.value.status_code == 404
    assert caught.value.body == {
        "message": "The model 'gpt-4o' does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


@pytest.mark.parametrize(
    ("method", "path", "content", "status", "param"),
    [
        ("POST", "/v1/chat/completions", b"{not json", 400, None),
        ("POST", "/v1/chat/completions", b'{"model": "llama3:8b"}', 400, "messages"),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400, None),
        (
            "POST",
            "/v1/embeddings",
            b'{"model": "llama3:8b", "input": []}',
            400,
            "input",
        ),
        ("GET", "/v1/chat/completions", b"", 405, None),
        ("POST", "/v1/models", b"", 405, None),
        ("GET", "/v1/nothing-here", b"", 404, None),
        ("POST", "/_mock/config", b'{"latency_ms": -5}', 400, "latency_ms"),
        ("POST", "/_mock/config", b'{"no_such_knob": 1}', 400, "no_such_knob"),
    ],
)
def test_bad_requests_get_openai_errors(
    mock: Mock,
    method: str,
    path: str,
    content: bytes,
    status: int,
    param: str | None,
) -> None:
    response = mock.http.request(method, path, content=content)

    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_injected_failures_always_fail_at_rate_one(mock: Mock) -> None:
    mock.configure(fail_status=503, error_rate=1)
    client = mock.client()

    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(
            model="llama3:8b", messages=[{"role": "user", "content": "hi"}]
        )

    assert caught.value.status_code == 503
    assert caught.value.code == "mock_injected_failure"
    # Only inference fails; the backend still lists its models.
    assert len(client.models.list().data) == 2
    assert mock.stats()["injected_failures"] == 1


def test_fail_on_text_fails_only_the_requests_holding_it(mock: Mock) -> None:
    mock.configure(fail_on_text="POISON", fail_status=500)

    def status(content: str, model: str = "llama3:8b") -> int:
        body = {"model": model, "messages": [{"role": "user", "content": content}]}
        return mock.http.post("/v1/chat/completions", json=body).status_code

    assert status("a POISON pill") == 500
    assert status("fine") == 200
    assert mock.stats()["injected_failures"] == 1


def test_error_rate_is_reproducible_with_the_seed(mock: Mock) -> None:
    body = {"model": "llama3:8b", "messages": [{"role": "user", "content": "hi"}]}

    def statuses() -> list[int]:
        mock.configure(error_rate=0.5, fail_status=429)
        return [
            mock.http.post("/v1/chat/completions", json=body).status_code
            for _ in range(24)
        ]

    first = statuses()
    mock.http.post("/_mock/reset")
    assert statuses() == first
    assert set(first) == {200, 429}


def test_drop_after_chunks_breaks_the_sdk_stream(mock: Mock) -> None:
    mock.configure(drop_after_chunks=2)
    stream = mock.client().chat.completions.create(
        model="llama3:8b",
        messages=[{"role": "user", "content": "tell me more"}],
        stream=True,
    )
    texts = []

    # The chunked body never ended: openai 1.x and 2.x let httpx's error
    # through, 3.x wraps it (from httpx2) in an APIConnectionError.
    with pytest.raises((httpx.RemoteProtocolError, openai.APIConnectionError)) as e:
        for chunk in stream:
            texts.append(chunk.choices[0].delta.content)
    error = e.value
    assert "incomplete chunked read" in f"{error} {error.__cause__}"

    whole = "[mock-a/llama3:8b] echo: tell me more"
    assert texts == [whole[:9], whole[9:18]]
    assert mock.stats()["dropped_streams"] == 1


def test_refuse_for_ms_refuses_connections_then_comes_back(
    mock: Mock,
) -> None:
    assert mock.configure(refuse_for_ms=300)["listening"] is False
    client = mock.client()

    with pytest.raises(openai.APIConnectionError):
        client.models.list()

    def is_back() -> bool:
        try:
            return len(mock.client().models.list().data) == 2
        except openai.APIConnectionError:
            return False

    wait_for(is_back)
    assert mock.configure()["listening"] is True


def test_api_key_is_enforced_and_recorded(mock: Mock) -> None:
    mock.configure(api_key="sk-right")

    with pytest.raises(openai.AuthenticationError):
        mock.client(api_key="sk-wrong").models.list()
    no_header = mock.http.get("/v1/models")
    assert no_header.status_code == 401
    assert no_header.json()["error"]["code"] == "invalid_api_key"
    completion = mock.client(api_key="sk-right").chat.completions.create(
        model="llama3:8b", messages=[{"role": "user", "content": "secret"}]
    )
    assert completion.choices[0].message.content == "[mock-a/llama3:8b] echo: secret"

    last = mock.stats()["last_requests"][-1]
    assert last["method"] == "POST"
    assert last["path"] == "/v1/chat/completions"
    assert last["headers"]["authorization"] == "Bearer sk-right"
    assert json.loads(last["body"])["messages"][0]["content"] == "secret"
    assert last["status"] == 200


def test_stats_count_requests_and_a_mid_stream_disconnect(
    mock: Mock,
) -> None:
    mock.configure(chunks=6, chunk_delay_ms=150)
    client = mock.client()
    client.models.list()
    client.chat.completions.create(
        model="llama3:8b", messages=[{"role": "user", "content": "hi"}]
    )
    body = {
        "model": "llama3:8b",
        "messages": [{"role": "user", "content": "a long answer please"}],
        "stream": True,
    }

    # A client of its own, so that closing its connection is the disconnect.
    with (
        httpx.Client(base_url=mock.base_url, verify=False) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        # Keep a reference: a dropped iterator closes the response when collected.
        pieces = response.iter_raw()
        assert next(pieces).startswith(b"data: ")
        assert mock.stats()["in_flight"] == 1
        assert mock.stats()["client_disconnects"] == 0
    # Leaving the block closed the connection with the stream unfinished.

    wait_for(lambda: mock.stats()["client_disconnects"] == 1)
    stats = mock.stats()
    assert stats["requests"] == {"/v1/models": 1, "/v1/chat/completions": 2}
    assert stats["requests_total"] == 3
    assert stats["responses"] == {"200": 3}
    assert stats["in_flight"] == 0


def test_latency_delays_the_response(mock: Mock) -> None:
    mock.configure(latency_ms=250)
    client = mock.client()

    started = time.monotonic()
    client.models.list()

    assert time.monotonic() - started >= 0.25


def test_a_long_prompt_adds_its_prefill_time(mock: Mock) -> None:
    mock.configure(prefill_ms_per_1k_tokens=100)
    client = mock.client()

    def timed(content: str) -> float:
        started = time.monotonic()
        client.chat.completions.create(
            model="mistral:7b", messages=[{"role": "user", "content": content}]
        )
        return time.monotonic() - started

    assert timed("word " * 8000) >= 0.95  # 40,000 bytes: 10,000 tokens
    assert timed("hi") < 0.5


def test_http_pipelining_chunked_bodies_and_connection_close(
    mock: Mock,
) -> None:
    body = b'{"model": "llama3:8b", "messages": [{"role": "user", "content": "x"}]}'
    requests = (
        b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%b\r\n" % (len(body[:10]), body[:10])
        + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body[10:]), body[10:])
        + b"GET /v1/models/llama3%3A8b HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )

    with socket.create_connection(("127.0.0.1", mock.port), timeout=5) as sock:
        sock.sendall(requests)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk

    # All three answered in order, then the server closed the connection.
    responses = received.split(b"HTTP/1.1 200 OK\r\n")
    assert len(responses) == 4
    assert b'"object":"list"' in responses[1]
    assert b"[mock-a/llama3:8b] echo: x" in responses[2]
    assert b'"object":"model"' in responses[3]
    assert b'"object":"list"' not in responses[3]
    assert b"Connection: close\r\n" in responses[3]


def test_cli_flags_set_auth_failures_and_dimensions(
    mock_backend_factory: Callable[..., MockBackendProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A database nobody can reach: the mock must serve without ever querying it.
    monkeypatch.setenv("DATABASE_URL", "postgres://nexus@127.0.0.1:9/unreachable")
    args = (
        "--name", "mock-b", "--models", "m1", "--api-key", "sk-b",
        "--fail-status", "503", "--embedding-dim", "16", "--latency-ms", "1",
    )  # fmt: skip
    backend = control(mock_backend_factory(*args))
    client = backend.client(api_key="sk-b")

    with pytest.raises(openai.AuthenticationError):
        backend.client(api_key="sk-other").models.list()
    assert [model.id for model in client.models.list()] == ["m1"]
    # --fail-status alone fails every inference request.
    with pytest.raises(openai.InternalServerError) as caught:
        client.embeddings.create(model="m1", input="hi")
    assert caught.value.status_code == 503
    config = backend.http.get("/_mock/config").json()
    assert config["embedding_dim"] == 16
    assert config["error_rate"] == 1.0
    backend.configure(error_rate=0)
    assert len(client.embeddings.create(model="m1", input="hi").data[0].embedding) == 16


def test_refuse_flag_listens_after_sigusr1_and_sigint_stops_it(
    mock_backend_factory: Callable[..., MockBackendProcess],
) -> None:
    backend = control(mock_backend_factory("--models", "m1", "--refuse"))

    with pytest.raises(httpx.ConnectError):
        backend.http.get("/v1/models")
    backend.process.process.send_signal(signal.SIGUSR1)

    def answers() -> bool:
        try:
            return backend.http.get("/v1/models").status_code == 200
        except httpx.ConnectError:
            return False

    wait_for(answers)
    backend.process.process.send_signal(signal.SIGINT)
    assert backend.process.process.wait(timeout=10) == 0


def test_sigterm_stops_it_mid_stream_with_status_zero(
    mock_backend_factory: Callable[..., MockBackendProcess],
) -> None:
    backend = mock_backend_factory("--models", "m1", "--chunk-delay-ms", "5000")
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}

    with (
        httpx.Client(base_url=backend.base_url, verify=False) as http,
        http.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}
        ) as response,
    ):
        pieces = response.iter_raw()
        assert next(pieces).startswith(b"data: ")
        backend.process.terminate()
        assert backend.process.wait(timeout=10) == 0
        with pytest.raises(httpx.RemoteProtocolError):
            for _ in pieces:
                pass

    assert backend.process.stdout is not None
    assert "stopped" in backend.process.stdout.read()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", " , "], "--models: models must name at least one model"),
        (["--models", "m", "--error-rate", "2"], "--error-rate: error_rate must be"),
        (["--models", "m", "--chunks", "0"], "--chunks: chunks must be a whole"),
    ],
)
def test_invalid_flags_fail_with_a_clear_message(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("nexus_mock_backend", "--port", "0", *args)


def test_python_m_rejects_a_bad_flag_with_usage_status_and_message() -> None:
    finished = subprocess.run(
        [sys.executable, "-m", "nexus_mock", "--models", "m"]
        + ["--port", "0", "--chunks", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert finished.returncode == 2
    assert "--chunks: chunks must be a whole" in finished.stderr


def test_the_manage_py_command_serves_like_python_m() -> None:
    process = subprocess.Popen(
        [sys.executable, "manage.py", "nexus_mock_backend", "--port", "0"]
        + ["--models", "m1", "--name", "legacy"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    mock = MockBackendProcess(process, "")
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "Mock backend 'legacy' listening on http://127.0.0.1:" in line
        mock.base_url = line.split("listening on ")[1].split()[0]
        listed = httpx.get(f"{mock.base_url}/v1/models").json()
        assert [model["id"] for model in listed["data"]] == ["m1"]
    finally:
        mock.stop()
    assert process.returncode == 0


def test_spawn_reports_the_childs_output_when_the_mock_cannot_start() -> None:
    with pytest.raises(MockStartError, match="--models: models must name"):
        spawn_mock_backend("--models", " , ")


def test_spawn_gives_up_on_a_silent_child_after_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(MockStartError, match="did not start within 0.5 s"):
        spawn_mock_backend(
            "--models", "m1", command_prefix=("sh", "-c", "exec sleep 30", "sh"),
            timeout=0.5,
        )  # fmt: skip
    assert time.monotonic() - started < 10


# --kind: the probe endpoints of other servers (the adapters in backends.kinds
# are tested against them in test_kinds.py).


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", "m", "--kind", "triton"], "invalid choice: 'triton'"),
        (["--models", "m", "--context-length", "0"], "--context-length: context"),
    ],
)
def test_invalid_kind_flags_fail_with_a_clear_message(
    args: list[str], message: str
) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("nexus_mock_backend", "--port", "0", *args)


def test_kind_knobs_are_validated_at_runtime(shared_mock: Mock) -> None:
    for knobs, param in (
        ({"kind": "triton"}, "kind"),
        ({"loading": "yes"}, "loading"),
        ({"loaded_models": 3}, "loaded_models"),
    ):
        response = shared_mock.http.post("/_mock/config", json=knobs)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == param
    shared_mock.http.post("/_mock/reset")


def test_the_openai_kind_has_no_other_servers_endpoints(shared_mock: Mock) -> None:
    for path in ("/health", "/api/tags", "/props"):
        assert shared_mock.http.get(path).status_code == 404


def test_a_mock_switches_kind_at_runtime(shared_mock: Mock) -> None:
    try:
        shared_mock.configure(kind="ollama", loaded_models=["mistral:7b"])
        tags = shared_mock.http.get("/api/tags").json()
        assert [m["name"] for m in tags["models"]] == MODELS
        ps = shared_mock.http.get("/api/ps").json()
        assert [m["name"] for m in ps["models"]] == ["mistral:7b"]
        # Ollama still speaks OpenAI under /v1.
        reply = shared_mock.client().chat.completions.create(
            model="llama3:8b", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content == "[mock-a/llama3:8b] echo: hi"
    finally:
        shared_mock.http.post("/_mock/reset")
    assert shared_mock.http.get("/api/tags").status_code == 404


def test_ollama_kind_answers_in_ollamas_shapes(
    mock_backend_factory: Callable[..., MockBackendProcess],
) -> None:
    process = mock_backend_factory(
        "--kind", "ollama", "--models", "llava:7b", "--vision-models", "llava:7b"
    )
    with httpx.Client(base_url=process.base_url) as http:
        shown = http.post("/api/show", json={"model": "llava:7b"}).json()
        assert shown["capabilities"] == ["completion", "vision"]
        assert shown["model_info"]["llama.context_length"] == 8192
        missing = http.post("/api/show", json={"model": "nope"})
        assert (missing.status_code, missing.json()) == (
            404,
            {"error": "model 'nope' not found"},
        )
        assert http.get("/api/version").json() == {"version": "0.6.8"}


def test_llamacpp_kind_is_unavailable_everywhere_while_loading(
    mock_backend_factory: Callable[..., MockBackendProcess],
) -> None:
    process = mock_backend_factory(
        "--kind", "llamacpp", "--models", "phi-4", "--loading"
    )
    with httpx.Client(base_url=process.base_url) as http:
        loading = {
            "error": {
                "code": 503,
                "message": "Loading model",
                "type": "unavailable_error",
            }
        }
        for method, path in (("GET", "/health"), ("POST", "/v1/chat/completions")):
            response = http.request(method, path, json={})
            assert (response.status_code, response.json()) == (503, loading)
        http.post("/_mock/config", json={"loading": False})
        assert http.get("/health").json() == {"status": "ok"}
        props = http.get("/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 8192


def test_anthropic_kind_checks_its_own_headers(
    mock_backend_factory: Callable[..., MockBackendProcess],
) -> None:
    process = mock_backend_factory(
        "--kind", "anthropic", "--models", "claude-sonnet-4", "--api-key", "k-1"
    )
    headers = {"x-api-key": "k-1", "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=process.base_url) as http:
        listed = http.get("/v1/models", headers=headers).json()
        assert [m["id"] for m in listed["data"]] == ["claude-sonnet-4"]
        assert listed["data"][0]["type"] == "model"
        # anthropic 2.x sends the key as a bearer token, which Anthropic takes.
        version = {"anthropic-version": "2023-06-01"}
        bearer = http.get(
            "/v1/models", headers={"authorization": "Bearer k-1", **version}
        )
        assert bearer.status_code == 200
        wrong = http.get(
            "/v1/models", headers={"authorization": "Bearer k-2", **version}
        )
        assert wrong.status_code == 401
        assert wrong.json()["error"]["type"] == "authentication_error"
        unversioned = http.get("/v1/models", headers={"x-api-key": "k-1"})
        assert unversioned.status_code == 400
        chat = http.post("/v1/chat/completions", headers=headers, json={})
        assert chat.status_code == 404


def test_slots_serve_a_few_at_once_and_queue_the_rest_in_order() -> None:
    process = spawn_mock_backend(
        "--models", "m", "--slots", "2", "--latency-ms", "300", "--name", "slotted"
    )
    mock = control(process)
    try:
        ask = functools.partial(_ask, mock.client())

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            finished = sorted(pool.map(ask, [str(i) for i in range(5)]))
        stats = mock.stats()
        assert stats["peak_busy_slots"] == 2
        assert stats["peak_waiting_for_slot"] == 3
        assert stats["peak_outstanding"] == 5
        assert (stats["busy_slots"], stats["waiting_for_slot"]) == (0, 0)
        # Three rounds of 300 ms: two, two, then one.
        assert finished[-1] - started >= 0.85
        # A client that gives up while waiting for a slot is never served.
        mock.http.post("/_mock/reset")
        mock.configure(latency_ms=1000, slots=1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            holder = pool.submit(ask, "holds the slot")
            _wait_until(lambda: mock.stats()["busy_slots"] == 1)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{mock.base_url}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                    timeout=0.3,
                )
            holder.result()
        _wait_until(lambda: mock.stats()["waiting_for_slot"] == 0)
        stats = mock.stats()
        assert stats["client_disconnects"] == 1
        assert stats["responses"] == {"200": 2}  # answered or counted at arrival
        assert stats["busy_slots"] == 0
    finally:
        mock.http.close()
        process.stop()


def _ask(client: openai.OpenAI, text: str) -> float:
    """Ask the mock a chat question; return when the answer came."""
    client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}]
    )
    return time.monotonic()


def _wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_held_requests_wait_in_their_slots_until_the_last_one_arrives() -> None:
    process = spawn_mock_backend("--models", "m", "--slots", "4", "--name", "held")
    mock = control(process)
    try:
        ask = functools.partial(_ask, mock.client())

        assert mock.http.post("/_mock/hold", json={"first": 3}).json() == {"holding": 3}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(ask, "one")
            _wait_until(lambda: mock.stats()["busy_slots"] == 1)
            second = pool.submit(ask, "two")
            _wait_until(lambda: mock.stats()["busy_slots"] == 2)
            assert not first.done() and not second.done()  # held in their slots
            last = time.monotonic()
            third = pool.submit(ask, "three")
            assert min(f.result(timeout=10) for f in (first, second, third)) >= last
        # Later requests are not held; /_mock/release lets held ones go early.
        ask("four")
        mock.http.post("/_mock/hold", json={"first": 5})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(ask, "held")
            _wait_until(lambda: mock.stats()["busy_slots"] == 1)
            assert mock.http.post("/_mock/release").json() == {"released": 1}
            held.result(timeout=10)
        assert mock.http.post("/_mock/hold", json={"first": 0}).status_code == 400
    finally:
        mock.http.close()
        process.stop()
