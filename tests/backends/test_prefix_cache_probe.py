"""What the servers say of their prompt caches, read on the health round:
vLLM's prefix cache counters and size (/metrics), llama.cpp's slots x context
(/props); stored on the backend, shown in the admin and the dashboard's rows,
and sizing the backend's cache in the prefix index."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from django.test import Client

from backends.health import check_all, read_backend_health
from backends.kinds import Endpoint, get_adapter
from backends.kinds.adapters import read_vllm_prefix_cache
from backends.models import Backend
from routing.snapshot import build_snapshot
from tests.backends.mock_fleet import KindMock, running_mocks

VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 12000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 8000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 9000.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 6000.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="31000"} 1.0
"""


@pytest.fixture(scope="module")
def mocks() -> Iterator[dict[str, KindMock]]:
    specs = (
        ("vllm", "--models", "m", "--prefix-block-chars", "64",
         "--prefix-cache-blocks", "500"),
        ("llamacpp", "--models", "q", "--context-length", "4096", "--slots", "4"),
    )  # fmt: skip
    with running_mocks(*specs) as started:
        yield {mock.kind: mock for mock in started}


def _chat(mock: KindMock, text: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    mock.http.post("/v1/chat/completions", json=body).raise_for_status()


def test_vllm_counters_are_summed_over_engines_and_the_size_read() -> None:
    report = read_vllm_prefix_cache(VLLM_METRICS)
    assert report is not None
    assert (report.hits, report.queries) == (15000, 20000)
    assert report.cache_tokens == 31000 * 16
    assert read_vllm_prefix_cache("vllm:gpu_cache_usage_perc 0.5\n") is None
    broken = read_vllm_prefix_cache('vllm:cache_config_info{num_gpu_blocks="x"} 1\n')
    assert broken is None


async def test_probes_read_the_prompt_cache(mocks: dict[str, KindMock]) -> None:
    vllm, llamacpp = mocks["vllm"], mocks["llamacpp"]
    vllm.reset()
    _chat(vllm, "a" * 640)
    _chat(vllm, "a" * 640 + " and more")
    async with httpx.AsyncClient(timeout=5) as client:
        seen = await get_adapter("vllm").probe(
            client, Endpoint("v", "vllm", vllm.base_url)
        )
        slots = await get_adapter("llamacpp").probe(
            client, Endpoint("l", "llamacpp", llamacpp.base_url)
        )
    assert seen.prefix_cache is not None
    hits, queries = seen.prefix_cache.hits, seen.prefix_cache.queries
    assert hits is not None and queries is not None
    assert 0 < hits < queries  # the second prompt found the first one's blocks
    assert seen.prefix_cache.cache_tokens == 500 * 16
    assert slots.prefix_cache is not None
    assert slots.prefix_cache.cache_tokens == 4 * 4096


@pytest.mark.django_db
def test_the_health_round_stores_it_for_routing_the_admin_and_the_dashboard(
    mocks: dict[str, KindMock], admin_client: Client
) -> None:
    vllm = mocks["vllm"]
    vllm.reset()
    _chat(vllm, "b" * 640)
    _chat(vllm, "b" * 640)
    backend = vllm.register("gpu-1")
    check_all()
    backend.refresh_from_db()
    assert backend.prefix_cache_reported_tokens == 8000
    rate = backend.prefix_cache_hit_rate
    assert rate is not None and 0.4 < rate < 0.6
    # The index sizes the backend by what it reports, unless the operator says.
    assert build_snapshot().backends_by_name["gpu-1"].prefix_cache_tokens == 8000
    Backend.objects.filter(pk=backend.pk).update(prefix_cache_tokens=100)
    assert build_snapshot().backends_by_name["gpu-1"].prefix_cache_tokens == 100
    rows = {row["name"]: row for row in read_backend_health()}
    assert rows["gpu-1"]["prefix_cache_hit_rate"] == rate
    page = admin_client.get("/admin/backends/backend/")
    assert f"{rate:.0%}".encode() in page.content
    detail = admin_client.get(f"/admin/backends/backend/{backend.pk}/change/")
    assert b"prompt tokens found in its cache" in detail.content
