"""The mock's Ollama model management, driven by the official ollama client.

Pull, push, create, copy and delete answer as Ollama does (NDJSON progress
ending in ``{"status": "success"}``, or 200 with an empty body; errors as
``{"error": ...}`` with Ollama's statuses), and the node's model list (its
/api/tags, and what it serves) changes once the operation is over.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import ollama
import pytest

from nexus_mock import MockBackendProcess, spawn_mock_backend

pytestmark = pytest.mark.mode_independent


@pytest.fixture(scope="module")
def process() -> Iterator[MockBackendProcess]:
    process = spawn_mock_backend(
        "--kind", "ollama", "--name", "olla", "--models", "llama3:8b,nomic-embed"
    )
    yield process
    process.stop()


@pytest.fixture
def client(process: MockBackendProcess) -> ollama.Client:
    assert httpx.post(f"{process.base_url}/_mock/reset", timeout=10).status_code == 200
    return ollama.Client(host=process.base_url, timeout=10)


def _tags(client: ollama.Client) -> list[str]:
    return [m.model or "" for m in client.list().models]


def test_a_pull_streams_progress_and_then_the_model_is_served(
    client: ollama.Client,
) -> None:
    parts = list(client.pull("qwen3:0.6b", stream=True))
    assert [p.status for p in parts[:1] + parts[-3:]] == [
        "pulling manifest",
        "verifying sha256 digest",
        "writing manifest",
        "success",
    ]
    layer = [p for p in parts if p.total]
    assert layer[0].completed == 0 and layer[-1].completed == layer[-1].total
    assert layer[0].digest and layer[0].digest.startswith("sha256:")
    assert _tags(client) == ["llama3:8b", "nomic-embed", "qwen3:0.6b"]
    reply = client.generate(model="qwen3:0.6b", prompt="hi", stream=False)
    assert reply.done


def test_without_streaming_only_success_comes_back(client: ollama.Client) -> None:
    assert client.pull("phi3", stream=False).status == "success"
    assert client.push("phi3", stream=False).status == "success"
    assert "phi3" in _tags(client)


def test_copy_create_and_delete(client: ollama.Client) -> None:
    assert client.copy("llama3:8b", "mine").status == "success"
    created = list(client.create("pirate", from_="mine", system="Arr", stream=True))
    assert any("creating new layer" in (p.status or "") for p in created)
    assert client.delete("mine").status == "success"
    assert _tags(client) == ["llama3:8b", "nomic-embed", "pirate"]


@pytest.mark.parametrize(
    ("call", "status", "message"),
    [
        (lambda c: c.delete("ghost"), 404, "model 'ghost' not found"),
        (lambda c: c.copy("ghost", "x"), 404, "model 'ghost' not found"),
        (lambda c: c.push("ghost", stream=False), 404, 'model "ghost" not found'),
        (lambda c: c.create("x", from_="ghost"), 404, "model 'ghost' not found"),
        (lambda c: c.create("x"), 400, "neither 'from' or 'files' was specified"),
    ],
)
def test_errors_are_in_ollamas_shape(
    client: ollama.Client, call: object, status: int, message: str
) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        call(client)  # type: ignore[operator]
    assert (caught.value.status_code, caught.value.error) == (status, message)
    assert _tags(client) == ["llama3:8b", "nomic-embed"]


def test_the_wrong_method_is_a_405(process: MockBackendProcess) -> None:
    answer = httpx.post(
        f"{process.base_url}/api/delete", json={"model": "llama3:8b"}, timeout=10
    )
    assert answer.status_code == 405
    assert answer.json() == {"error": "405 method not allowed"}
