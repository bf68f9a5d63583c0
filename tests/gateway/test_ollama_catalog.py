"""Ollama's /api/tags, /api/ps and /api/show built from the router snapshot."""

from __future__ import annotations

import json

import ollama
import pytest

from gateway.proxy.ollama_catalog import OllamaCatalog
from routing.core import RouterSnapshot
from tests.routing.core_builders import backend, model, snapshot

pytestmark = pytest.mark.mode_independent


def fleet() -> RouterSnapshot:
    return snapshot(
        backend(
            "gpu-1",
            model("llama3:8b", context_length=8192, supports_tools=True, loaded=True),
            model("qwen:7b", context_length=4096, loaded=False),
            kind="ollama",
        ),
        backend(
            "vllm-1",
            model("llama3:8b", context_length=16384, supports_vision=True),
            kind="vllm",
        ),
        backend("down", model("gone:1b"), status="unhealthy"),
        aliases={"gpt-4": "llama3:8b"},
    )


def test_tags_list_served_models_and_aliases_as_the_client_reads_them():
    tags = ollama.ListResponse(**json.loads(OllamaCatalog().tags(fleet())))
    assert [m.model for m in tags.models] == [
        "llama3:8b",
        "qwen:7b",
        "gpt-4",
        "moe-llama3:8b",  # two backends serve llama3:8b
    ]


def test_an_ensembles_show_is_its_models_without_tools():
    shown = ollama.ShowResponse(
        **json.loads(OllamaCatalog().show(fleet(), "moe-llama3:8b"))
    )
    assert shown.capabilities == ["completion", "vision"]
    assert OllamaCatalog().show(fleet(), "moe-qwen:7b") is None


def test_ps_lists_models_ready_without_loading():
    ps = ollama.ProcessResponse(**json.loads(OllamaCatalog().ps(fleet())))
    # qwen is on an Ollama backend that has not loaded it; vLLM keeps its loaded.
    assert [(m.model, m.context_length) for m in ps.models] == [("llama3:8b", 8192)]


def test_show_merges_capabilities_and_takes_the_smallest_context():
    catalog = OllamaCatalog()
    shown = ollama.ShowResponse(**json.loads(catalog.show(fleet(), "llama3:8b")))
    assert shown.capabilities == ["completion", "vision", "tools"]
    assert shown.modelinfo == {
        "general.architecture": "nexus",
        "nexus.context_length": 8192,
    }
    assert catalog.show(fleet(), "gpt-4") is not None
    assert catalog.show(fleet(), "gone:1b") is None
