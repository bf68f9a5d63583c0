"""The mock Ollama node of a fleet: sizes, memory, cold loads, eviction, keep_alive."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import ollama
import pytest

from tests.conftest import MockBackendProcess

pytestmark = pytest.mark.mode_independent

Factory = Callable[..., MockBackendProcess]


def _node(factory: Factory, *extra: str) -> MockBackendProcess:
    return factory(
        "--kind",
        "ollama",
        "--name",
        "node",
        "--model",
        "small:2",
        "--model",
        "llama3:8b:4.7",
        "--model",
        "big:5",
        "--memory-gb",
        "8",
        "--loaded-models",
        "",
        *extra,
    )


def _stats(node: MockBackendProcess) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{node.base_url}/_mock/stats").json()
    return stats


def _loaded(node: MockBackendProcess) -> list[str]:
    ps = httpx.get(f"{node.base_url}/api/ps").json()
    return [entry["name"] for entry in ps["models"]]


def test_a_cold_model_loads_once_for_every_request_waiting_for_it(
    mock_backend_factory: Factory,
) -> None:
    node = _node(mock_backend_factory, "--load-seconds", "0.5")
    client = ollama.AsyncClient(host=node.base_url)

    async def burst() -> list[Any]:
        return await asyncio.gather(
            *(
                client.chat(model="small", messages=[{"role": "user", "content": "hi"}])
                for _ in range(3)
            )
        )

    started = time.monotonic()
    replies = asyncio.run(burst())
    assert time.monotonic() - started >= 0.5  # waited for the load
    assert all("echo: hi" in reply.message.content for reply in replies)
    stats = _stats(node)
    assert stats["loads"] == {"small": 1}
    ps = ollama.Client(host=node.base_url).ps()
    [entry] = ps.models
    assert entry.model == "small"
    assert entry.size_vram == 2_000_000_000
    assert entry.context_length == 8192
    assert entry.expires_at is not None
    # Hot now: the next request loads nothing.
    ollama.Client(host=node.base_url).generate(model="small", prompt="again")
    assert _stats(node)["loads_total"] == 1


def test_a_model_that_does_not_fit_evicts_the_least_recently_used(
    mock_backend_factory: Factory,
) -> None:
    node = _node(mock_backend_factory)
    client = ollama.Client(host=node.base_url)
    client.generate(model="small")  # 2 GB: load only, no prompt
    client.generate(model="llama3:8b")  # 4.7 GB: 6.7 of 8
    client.generate(model="small", prompt="use me")  # small is now the most recent
    client.generate(model="big")  # 5 GB: llama3:8b goes
    assert _loaded(node) == ["big", "small"]
    stats = _stats(node)
    assert stats["evictions_total"] == 1
    assert stats["loads"] == {"small": 1, "llama3:8b": 1, "big": 1}
    assert stats["memory_used_gb"] == 7.0


def test_keep_alive_zero_unloads_after_the_request(
    mock_backend_factory: Factory,
) -> None:
    node = _node(mock_backend_factory)
    client = ollama.Client(host=node.base_url)
    client.generate(model="small", prompt="once", keep_alive=0)
    assert _loaded(node) == []
    client.generate(model="small", prompt="kept", keep_alive="1s")
    assert _loaded(node) == ["small"]
    deadline = time.monotonic() + 10
    while _loaded(node) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _loaded(node) == []


def test_tags_and_show_report_the_sizes_given(mock_backend_factory: Factory) -> None:
    node = _node(mock_backend_factory)
    client = ollama.Client(host=node.base_url)
    sizes = {m.model: m.size for m in client.list().models}
    assert sizes == {"small": 2e9, "llama3:8b": 4.7e9, "big": 5e9}
    assert client.show("big").details.parameter_size == "8.3B"


def test_models_listed_as_loaded_start_hot(mock_backend_factory: Factory) -> None:
    node = mock_backend_factory(
        "--kind", "ollama", "--model", "a:3", "--model", "b:3", "--memory-gb", "4"
    )
    # Both are listed as loaded (the default), but only the first fits.
    assert _loaded(node) == ["a"]
    ollama.Client(host=node.base_url).generate(model="a", prompt="hot")
    assert _stats(node)["loads_total"] == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--model", "m:0"), "must be from 0 to 10000 GB"),
        (("--model", "m"), "must be from 0 to 10000 GB"),
    ],
)
def test_bad_model_sizes_are_refused_at_start(
    flags: tuple[str, ...], message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nexus_mock", "--kind", "ollama", *flags],
        capture_output=True,
        check=False,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_other_clients_models_take_memory_and_a_load_that_cannot_fit_fails_as_ollamas(
    mock_backend_factory: Factory,
) -> None:
    node = _node(mock_backend_factory)
    httpx.post(
        f"{node.base_url}/_mock/config",
        json={"resident_models": {"qwen2.5:7b": 4.0}, "oom_loads": "estimate"},
    ).raise_for_status()
    chat = {"model": "big", "messages": [{"role": "user", "content": "hi"}]}

    native = httpx.post(f"{node.base_url}/api/chat", json={**chat, "stream": False})
    compatible = httpx.post(f"{node.base_url}/v1/chat/completions", json=chat)
    small = httpx.post(f"{node.base_url}/api/chat", json={**chat, "model": "small"})

    assert _loaded(node) == ["qwen2.5:7b", "small"]  # /api/ps lists both
    # 5 GB does not fit beside the other client's 4 GB in 8: Ollama's words.
    assert native.status_code == 500
    assert native.json() == {
        "error": "model requires more system memory (4.7 GiB) than is available "
        "(3.7 GiB)"
    }
    assert compatible.status_code == 500
    assert "requires more system memory" in compatible.json()["error"]["message"]
    assert small.status_code == 200
    stats = _stats(node)
    assert (stats["loads_refused"], stats["memory_used_gb"]) == (2, 6.0)
    httpx.post(
        f"{node.base_url}/_mock/config", json={"oom_loads": "runner"}
    ).raise_for_status()
    runner = httpx.post(f"{node.base_url}/api/chat", json={**chat, "stream": False})
    assert runner.json() == {
        "error": "llama runner process has terminated: CUDA error: out of memory"
    }
