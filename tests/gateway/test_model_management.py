"""Ollama model management through Nexus, with real processes and the ollama client.

Two Ollama mocks (``olla1``, ``olla2``: pull, push, copy, create and delete
change their model lists as Ollama's do) and an OpenAI-compatible one
(``oa``) sit behind a Nexus server. A key with ``can_manage_models`` pulls a
model onto the backend it names, sees the progress lines as the backend sends
them, and then finds the model in ``/api/tags`` and can chat with it; a key
without the permission gets 403 in Ollama's error shape, and the backend
choice rules answer 400/404 with the reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from django.core.management import call_command

from backends.models import Backend, BackendModel, HealthStatus
from gateway.proxy.errors import ProxyError
from gateway.proxy.model_backends import choose_backend
from routing.core import BackendSpec, RouterSnapshot
from routing.state import GatewayState
from tests.conftest import (
    MockBackendProcess,
    NexusServer,
    mock_stats,
    start_mock_backend,
    start_nexus_server,
    wait_until,
)
from usage.models import ApiKey

NATIVE = "llama3:8b"
# Lines of the mock's pull stream, and the pause it makes between them.
PULL_LINES = 9
LINE_DELAY_MS = 300
MAX_BLOB = 20 * 1024 * 1024


@dataclass
class Gateway:
    server: NexusServer
    olla1: MockBackendProcess
    olla2: MockBackendProcess
    oa: MockBackendProcess
    manager: str  # a key that may manage models
    user: str  # a key that may not
    scoped: str  # a key that may manage the llama3 models only

    def client(self, key: str, **headers: str) -> ollama.Client:
        return ollama.Client(
            host=self.server.base_url,
            headers={"Authorization": f"Bearer {key}", **headers},
            timeout=30,
        )

    def on(self, backend: str, key: str | None = None) -> ollama.Client:
        """A client that names `backend` for management (x-nexus-backend)."""
        return self.client(key or self.manager, **{"x-nexus-backend": backend})

    def listed(self) -> set[str]:
        return {m.model or "" for m in self.client(self.manager).list().models}

    def management_calls(self, mock: MockBackendProcess) -> int:
        requests = mock_stats(mock)["requests"]
        return sum(
            requests.get(path, 0)
            for path in ("/api/pull", "/api/push", "/api/copy", "/api/create")
        ) + requests.get("/api/delete", 0)


@pytest.fixture(scope="module")
def gateway(django_db_setup: None, django_db_blocker: Any) -> Iterator[Gateway]:
    olla1 = start_mock_backend(
        "--kind", "ollama", "--name", "olla1", "--models", NATIVE
    )
    olla2 = start_mock_backend(
        "--kind", "ollama", "--name", "olla2", "--models", NATIVE
    )
    oa = start_mock_backend("--name", "oa", "--models", "mistral:7b")
    with django_db_blocker.unblock():
        for name, mock, kind in (
            ("olla1", olla1, "ollama"),
            ("olla2", olla2, "ollama"),
            ("oa", oa, "openai"),
        ):
            backend = Backend.objects.create(
                name=name,
                base_url=mock.base_url,
                kind=kind,
                status=HealthStatus.HEALTHY,
                # olla2 must send something every second: a pull without a
                # stream that takes longer must still succeed.
                request_timeout=1.0 if name == "olla2" else 300.0,
            )
            BackendModel.objects.create(
                backend=backend, name=NATIVE if kind == "ollama" else "mistral:7b"
            )
        Backend.objects.create(
            name="far",
            base_url="relay://far",
            kind="relay",
            status=HealthStatus.HEALTHY,
        )
        _, manager = ApiKey.objects.create_key("ops", can_manage_models=True)
        _, user = ApiKey.objects.create_key("app")
        _, scoped = ApiKey.objects.create_key(
            "llama-ops", can_manage_models=True, allowed_models="llama3*"
        )
    # Bodies of 1 MiB at most, model files of 20 MiB: a file goes by its own
    # limit (and is streamed on, not read whole).
    server = start_nexus_server(
        NEXUS_BREAKER_FAILURES="1000000",
        NEXUS_MAX_BODY_BYTES=str(1024 * 1024),
        NEXUS_MAX_BLOB_BYTES=str(MAX_BLOB),
    )
    try:
        yield Gateway(server, olla1, olla2, oa, manager, user, scoped)
    finally:
        server.stop()
        for mock in (olla1, olla2, oa):
            mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture(autouse=True)
def _reset_mocks(gateway: Gateway) -> Iterator[None]:
    yield
    for mock in (gateway.olla1, gateway.olla2, gateway.oa):
        httpx.post(f"{mock.base_url}/_mock/reset", timeout=5)


def test_pull_streams_progress_then_the_model_is_listed_and_served(
    gateway: Gateway,
) -> None:
    httpx.post(
        f"{gateway.olla1.base_url}/_mock/config",
        json={"chunk_delay_ms": LINE_DELAY_MS},
        timeout=5,
    )
    arrived: list[tuple[float, ollama.ProgressResponse]] = []
    for part in gateway.on("olla1").pull("qwen3:0.6b", stream=True):
        arrived.append((time.monotonic(), part))
    statuses = [part.status for _, part in arrived]
    assert statuses[0] == "pulling manifest"
    assert statuses[-1] == "success"
    assert len(arrived) == PULL_LINES
    progress = [part.completed for _, part in arrived if part.completed is not None]
    assert progress == sorted(progress) and progress[-1] == arrived[1][1].total
    # Relayed as the backend sent them (8 pauses of 0.3 s between the first
    # line and the last), not gathered and sent at the end.
    assert arrived[-1][0] - arrived[0][0] >= 1.0
    # Discovery ran before the answer ended: listed and routed at once.
    assert "qwen3:0.6b" in gateway.listed()
    reply = gateway.client(gateway.user).chat(
        model="qwen3:0.6b", messages=[{"role": "user", "content": "hi"}], stream=False
    )
    assert "qwen3:0.6b" in (reply.message.content or "")
    assert mock_stats(gateway.olla2)["requests"].get("/api/pull", 0) == 0


def test_pull_without_streaming_answers_success_once(gateway: Gateway) -> None:
    done = gateway.on("olla2").pull("phi3:mini", stream=False)
    assert done.status == "success"
    assert "phi3:mini" in gateway.listed()


def test_a_pull_without_streaming_may_outlast_the_backends_read_timeout(
    gateway: Gateway,
) -> None:
    # The mock says nothing for 3.2 s when asked without a stream, as
    # Ollama does; olla2 must answer within 1 s between reads. Nexus asks for
    # the stream and answers the client with its last line.
    httpx.post(
        f"{gateway.olla2.base_url}/_mock/config",
        json={"chunk_delay_ms": 400},
        timeout=5,
    )
    started = time.monotonic()
    done = gateway.on("olla2").pull("gemma:7b", stream=False)
    assert done.status == "success"
    assert time.monotonic() - started >= 2.5  # 7 pauses between 9 lines
    assert "gemma:7b" in gateway.listed()


@pytest.mark.parametrize(
    "manage",
    [
        lambda client: client.pull("tinyllama", stream=False),  # POST /api/pull
        lambda client: client.push(NATIVE, stream=False),  # POST /api/push
        lambda client: client.delete(NATIVE),  # DELETE /api/delete
        lambda client: client.copy(NATIVE, "copied"),  # POST /api/copy
        lambda client: client.create("mine", from_=NATIVE),  # POST /api/create
    ],
)
def test_a_key_without_the_permission_gets_403_in_ollamas_shape(
    gateway: Gateway, manage: Callable[[ollama.Client], object]
) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        manage(gateway.on("olla1", key=gateway.user))
    assert caught.value.status_code == 403
    assert "can_manage_models" in caught.value.error
    assert gateway.management_calls(gateway.olla1) == 0


def test_a_key_limited_to_some_models_manages_only_those(gateway: Gateway) -> None:
    client = gateway.on("olla1", key=gateway.scoped)
    with pytest.raises(ollama.ResponseError) as caught:
        client.pull("mistral:7b")
    assert caught.value.status_code == 403
    assert "not allowed to use the model 'mistral:7b'" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.copy(NATIVE, "mistral:copy")  # the destination counts too
    assert caught.value.status_code == 403
    assert gateway.management_calls(gateway.olla1) == 0
    client.copy(NATIVE, "llama3:mine")
    assert "llama3:mine" in gateway.listed()
    client.delete("llama3:mine")


def test_copy_create_and_delete_change_the_listed_models(gateway: Gateway) -> None:
    client = gateway.on("olla1")
    client.copy(NATIVE, "llama3:copy")
    assert "llama3:copy" in gateway.listed()
    parts = list(
        client.create("llama3:pirate", from_=NATIVE, system="Arr", stream=True)
    )
    assert parts[-1].status == "success"
    assert "llama3:pirate" in gateway.listed()
    client.delete("llama3:copy")
    assert "llama3:copy" not in gateway.listed()
    assert "llama3:pirate" in gateway.listed()
    with pytest.raises(ollama.ResponseError) as caught:
        client.delete("llama3:copy")  # the backend's own 404, passed on
    assert caught.value.status_code == 404
    assert "not found" in caught.value.error


def test_push_relays_the_backends_progress(gateway: Gateway) -> None:
    parts = list(gateway.on("olla2").push(NATIVE, stream=True))
    assert parts[0].status == "retrieving manifest"
    assert parts[-1].status == "success"


def _manage(
    gateway: Gateway, query: str = "", key: str | None = None, **headers: str
) -> httpx.Response:
    return httpx.post(
        f"{gateway.server.base_url}/api/copy{query}",
        json={"source": NATIVE, "destination": "by-query"},
        headers={"Authorization": f"Bearer {key or gateway.manager}", **headers},
        timeout=30,
    )


def test_the_backend_may_be_named_in_the_query(gateway: Gateway) -> None:
    answered = _manage(gateway, "?backend=olla2")
    assert answered.status_code == 200
    assert answered.headers["x-nexus-backend"] == "olla2"
    assert mock_stats(gateway.olla2)["requests"]["/api/copy"] == 1
    assert mock_stats(gateway.olla1)["requests"].get("/api/copy", 0) == 0


@pytest.mark.parametrize(
    ("query", "headers", "status", "words"),
    [
        ("", {}, 400, "2 Ollama backends (olla1, olla2)"),
        ("?backend=gpu-9", {}, 404, "no backend named 'gpu-9'"),
        ("?backend=oa", {}, 400, "not an Ollama server (its kind is openai)"),
        ("?backend=olla1", {"x-nexus-backend": "olla2"}, 400, "different ones"),
    ],
)
def test_backend_choice_refusals_say_why(
    gateway: Gateway, query: str, headers: dict[str, str], status: int, words: str
) -> None:
    answered = _manage(gateway, query, **headers)
    assert answered.status_code == status
    assert words in answered.json()["error"]
    assert gateway.management_calls(gateway.olla1) == 0
    assert gateway.management_calls(gateway.olla2) == 0


def test_the_wrong_method_and_a_bad_body_are_400s_in_ollamas_shape(
    gateway: Gateway,
) -> None:
    wrong = httpx.post(
        f"{gateway.server.base_url}/api/delete?backend=olla1",
        json={"model": NATIVE},
        headers={"Authorization": f"Bearer {gateway.manager}"},
        timeout=30,
    )
    assert wrong.status_code == 405
    assert "error" in wrong.json()
    bad = httpx.post(
        f"{gateway.server.base_url}/api/pull?backend=olla1",
        content=b"[not json",
        headers={"Authorization": f"Bearer {gateway.manager}"},
        timeout=30,
    )
    assert bad.status_code == 400
    assert isinstance(bad.json()["error"], str)
    assert gateway.management_calls(gateway.olla1) == 0


def _state(*backends: BackendSpec) -> GatewayState:
    return GatewayState(
        version=1, routes=RouterSnapshot.build(backends=backends), keys={}
    )


def test_without_a_name_the_only_enabled_ollama_backend_is_chosen() -> None:
    state = _state(
        BackendSpec("gpu", "http://gpu:11434", kind="ollama"),
        BackendSpec("old", "http://old:11434", kind="ollama", enabled=False),
        BackendSpec("cloud", "http://cloud/v1", kind="openai"),
    )
    assert choose_backend(state, None).name == "gpu"
    # Named, a disabled one may be managed (pull before enabling it).
    assert choose_backend(state, "old").name == "old"
    with pytest.raises(ProxyError) as caught:
        choose_backend(_state(BackendSpec("cloud", "http://c/v1")), None)
    assert caught.value.status == 404
    assert "no enabled Ollama backend" in caught.value.message


def test_a_backend_that_is_down_is_a_502_in_ollamas_shape(gateway: Gateway) -> None:
    httpx.post(
        f"{gateway.olla2.base_url}/_mock/config",
        json={"refuse_for_ms": 3000},
        timeout=5,
    )
    with pytest.raises(ollama.ResponseError) as caught:
        gateway.on("olla2").pull("gemma:2b", stream=True).__next__()
    assert caught.value.status_code == 502
    assert "olla2 did not answer" in caught.value.error
    assert "gemma:2b" not in gateway.listed()
    wait_until(lambda: _listening(gateway.olla2), what="olla2 to listen again")


def _listening(mock: MockBackendProcess) -> bool:
    try:
        return httpx.get(f"{mock.base_url}/_mock/config", timeout=5).is_success
    except httpx.TransportError:
        return False


# --- model files (/api/blobs) and clients leaving --------------------------------


def _model_file(tmp_path: Path, size: int, seed: bytes) -> tuple[Path, str]:
    path = tmp_path / f"{seed.decode()}.gguf"
    block = hashlib.sha256(seed).digest() * 2048  # 64 KiB
    path.write_bytes((block * (size // len(block) + 1))[:size])
    return path, "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _blob(
    gateway: Gateway,
    method: str,
    digest: str,
    key: str | None = None,
    backend: str = "olla1",
    **kw: Any,
) -> httpx.Response:
    return httpx.request(
        method,
        f"{gateway.server.base_url}/api/blobs/{digest}?backend={backend}",
        headers={"Authorization": f"Bearer {key or gateway.manager}"},
        timeout=60,
        **kw,
    )


def test_a_model_file_uploads_and_creates_a_model_through_the_ollama_client(
    gateway: Gateway, tmp_path: Path
) -> None:
    """ollama create from a GGUF: the file (over the 1 MiB body limit) goes to
    the chosen backend, then the create that names it."""
    path, _ = _model_file(tmp_path, 3 * 1024 * 1024 + 5, b"weights")
    client = gateway.on("olla1")
    digest = client.create_blob(path)
    assert _blob(gateway, "HEAD", digest).status_code == 200
    assert mock_stats(gateway.olla1)["blob_bytes"] == path.stat().st_size
    done = client.create("mine:gguf", files={"model.gguf": digest})
    assert done.status == "success"
    assert "mine:gguf" in gateway.listed()
    # The other backend has no such file: its own 404, and its create refuses.
    assert _blob(gateway, "HEAD", digest, backend="olla2").status_code == 404
    with pytest.raises(ollama.ResponseError) as caught:
        gateway.on("olla2").create("theirs:gguf", files={"model.gguf": digest})
    assert caught.value.status_code == 400 and "not found" in caught.value.error
    client.delete("mine:gguf")


def test_the_async_client_streams_a_model_file_without_a_length(
    gateway: Gateway, tmp_path: Path
) -> None:
    path, expected = _model_file(tmp_path, 2 * 1024 * 1024, b"chunked")

    async def upload() -> str:
        client = ollama.AsyncClient(
            host=gateway.server.base_url,
            headers={
                "Authorization": f"Bearer {gateway.manager}",
                "x-nexus-backend": "olla2",
            },
            timeout=30,
        )
        return await client.create_blob(path)  # chunked: no content-length

    assert asyncio.run(upload()) == expected
    assert mock_stats(gateway.olla2)["blob_bytes"] == 2 * 1024 * 1024


def test_model_file_refusals_are_in_ollamas_shape(
    gateway: Gateway, tmp_path: Path
) -> None:
    path, digest = _model_file(tmp_path, 1024, b"small")
    wrong = _blob(gateway, "POST", "sha256:" + "0" * 64, content=path.read_bytes())
    assert wrong.status_code == 400
    assert "digest mismatch" in wrong.json()["error"]  # the backend's, passed on
    user = _blob(gateway, "POST", digest, key=gateway.user, content=b"x" * 1024)
    assert user.status_code == 403
    assert "can_manage_models" in user.json()["error"]
    anonymous = httpx.post(
        f"{gateway.server.base_url}/api/blobs/{digest}", content=b"x", timeout=30
    )
    assert anonymous.status_code == 401 and "error" in anonymous.json()
    big = _blob(gateway, "POST", digest, content=b"x" * (MAX_BLOB + 1))
    assert big.status_code == 413 and str(MAX_BLOB) in big.json()["error"]
    bad = _blob(gateway, "HEAD", "md5:abc")
    assert bad.status_code == 400
    far = httpx.post(
        f"{gateway.server.base_url}/api/blobs/{digest}?backend=far",
        headers={"Authorization": f"Bearer {gateway.manager}"},
        content=path.read_bytes(),
        timeout=30,
    )
    assert far.status_code == 501 and "relay worker" in far.json()["error"]
    assert mock_stats(gateway.olla1)["blob_bytes"] == 0


def test_management_of_a_relay_backend_without_its_worker_is_a_502(
    gateway: Gateway,
) -> None:
    # Served through its worker (tests/gateway/test_model_management_relay.py);
    # this one has none connected.
    with pytest.raises(ollama.ResponseError) as caught:
        gateway.on("far").pull("qwen3:0.6b")
    assert caught.value.status_code == 502
    assert "worker not connected" in caught.value.error


def test_a_client_leaving_mid_pull_ends_it_at_the_backend_and_discovery_runs(
    gateway: Gateway,
) -> None:
    """Ctrl-C on `ollama pull`: the backend sees its client go at once (Ollama
    then stops the download), and the backend's models are listed again."""
    httpx.post(
        f"{gateway.olla1.base_url}/_mock/config",
        json={"chunk_delay_ms": 500},
        timeout=5,
    )
    listings = mock_stats(gateway.olla1)["requests"].get("/api/tags", 0)
    left = time.monotonic()
    with httpx.stream(
        "POST",
        f"{gateway.server.base_url}/api/pull?backend=olla1",
        json={"model": "left:7b"},
        headers={"Authorization": f"Bearer {gateway.manager}"},
        timeout=30,
    ) as answer:
        lines = answer.iter_lines()
        assert json.loads(next(lines))["status"] == "pulling manifest"
        left = time.monotonic()
    # The whole pull would take 4 s more; the backend's client went at once.
    wait_until(
        lambda: mock_stats(gateway.olla1)["client_disconnects"] == 1,
        timeout=3,
        what="the backend to see its client go",
    )
    assert time.monotonic() - left < 3
    assert mock_stats(gateway.olla1)["in_flight"] == 0
    wait_until(
        lambda: mock_stats(gateway.olla1)["requests"].get("/api/tags", 0) > listings,
        what="discovery of olla1 after the pull ended",
    )
    # The pull was abandoned: the backend has no such model, nor Nexus.
    assert "left:7b" not in gateway.listed()
    tags = httpx.get(f"{gateway.olla1.base_url}/api/tags", timeout=5).json()
    assert "left:7b" not in {model["name"] for model in tags["models"]}


def test_a_model_file_is_streamed_on_not_held_in_memory(
    gateway: Gateway, tmp_path: Path
) -> None:
    """Under Daphne the body is spooled to disk; the gateway reads it on from
    there. Held in memory, a 30 MiB file would raise the process's peak.
    (olla1: olla2's 1 s read timeout can expire while a loaded mock digests
    30 MiB.)"""
    server = start_nexus_server(NEXUS_MAX_BLOB_BYTES=str(64 * 1024 * 1024))
    try:
        path, digest = _model_file(tmp_path, 30 * 1024 * 1024, b"memory")
        headers = {
            "Authorization": f"Bearer {gateway.manager}",
            "x-nexus-backend": "olla1",
        }
        url = f"{server.base_url}/api/blobs/{digest}"
        assert httpx.head(url, headers=headers, timeout=30).status_code == 404
        before = _peak_rss(server)
        with path.open("rb") as body:
            assert (
                httpx.post(url, headers=headers, content=body, timeout=60).status_code
                == 201
            )
        grown = _peak_rss(server) - before
    finally:
        server.stop()
    assert mock_stats(gateway.olla1)["blob_bytes"] == 30 * 1024 * 1024
    assert grown < 12 * 1024 * 1024, grown


def _peak_rss(server: NexusServer) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    (line,) = [line for line in status.splitlines() if line.startswith("VmHWM:")]
    return int(line.split()[1]) * 1024
