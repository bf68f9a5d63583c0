"""The mock's prompt cache: chained blocks, LRU capacity, time per block
computed, held across the slots; seen through a real mock process."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from nexus_mock.prefix_cache import PrefixCache
from tests.conftest import MockBackendProcess

pytestmark = pytest.mark.mode_independent


def _body(*contents: str) -> bytes:
    import json

    messages = [{"role": "user", "content": text} for text in contents]
    return json.dumps({"model": "m", "messages": messages}).encode()


def test_leading_blocks_held_are_hits_and_a_different_start_shares_nothing() -> None:
    cache = PrefixCache()
    long = "x" * 1000
    assert cache.compute(_body(long), 100, 50) == (0, 11)
    assert cache.compute(_body(long, "next"), 100, 50)[0] == 10  # all full blocks
    assert cache.compute(_body("y" + long), 100, 50)[0] == 0


def test_the_capacity_evicts_the_least_recently_used_tails_first() -> None:
    cache = PrefixCache()
    first, second = _body("a" * 1000), _body("b" * 1000)  # 11 blocks each
    cache.compute(first, 100, 15)
    cache.compute(second, 100, 15)
    held, total = cache.compute(first, 100, 15)
    # Only first's head outlived second: its 4 leading blocks.
    assert (held, total) == (4, 11)


def test_a_mock_charges_each_block_it_computes(
    mock_backend_factory: Callable[..., MockBackendProcess],
) -> None:
    mock = mock_backend_factory(
        "--models", "m", "--slots", "2", "--prefix-block-chars", "100",
        "--prefix-cache-blocks", "100", "--prefix-block-ms", "20",
    )  # fmt: skip
    with httpx.Client(base_url=mock.base_url, timeout=10) as client:
        body = _body("p" * 1000)
        started = time.perf_counter()
        cold = client.post("/v1/chat/completions", content=body)
        cold_seconds = time.perf_counter() - started
        warm = client.post("/v1/chat/completions", content=body)
        stats = client.get("/_mock/stats").json()
    assert cold.headers["x-mock-prefix-blocks"] == "0/11"
    assert cold_seconds >= 11 * 0.020
    assert warm.headers["x-mock-prefix-blocks"] == "11/11"
    assert (stats["prefix_cache_hits"], stats["prefix_cache_queries"]) == (11, 22)
