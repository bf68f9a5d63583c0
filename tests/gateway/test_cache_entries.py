"""The response cache's parts on their own: keys, entries, replays, stores."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import orjson
import pytest

from gateway.cache.entries import Entry, ReplyCollector, replay_chunks
from gateway.cache.keys import (
    canonical_request,
    is_deterministic,
    native_fields,
    request_digest,
)
from gateway.cache.service import entry_key
from gateway.cache.stores import ENTRY_OVERHEAD, MemoryStore, RedisStore
from gateway.protocols.openai import ChatStreamWriter


def digest(body: dict[str, Any], model: str = "m", endpoint: str = "chat") -> str:
    return request_digest(canonical_request(body, model, endpoint))


def test_the_key_ignores_order_numbers_spelling_and_fields_without_effect() -> None:
    base = {
        "model": "alias",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "max_tokens": 10,
    }
    same = {
        "max_tokens": 10.0,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u1",
        "metadata": {"a": 1},
        "n": 1,
        "messages": [{"content": "hi", "role": "user"}],
        "model": "other-alias",
    }
    assert digest(base) == digest(same)
    assert digest(base) != digest({**base, "n": 2})
    assert digest(base) != digest({**base, "temperature": 0.5})
    assert digest(base) != digest(base, model="m2")
    assert digest(base) != digest(base, endpoint="embeddings")
    # The scope and the model are in the store's key too.
    assert entry_key("m", "nx-a", "d") != entry_key("m", "", "d")
    assert entry_key("m", "nx-a", "d") != entry_key("m2", "nx-a", "d")


def test_native_fields_the_canonical_form_leaves_out_count() -> None:
    assert native_fields("anthropic", {"thinking": {"budget_tokens": 5}}) == {
        "thinking": {"budget_tokens": 5}
    }
    assert native_fields("ollama", {"options": {"temperature": 0, "seed": 1}}) == {}
    assert native_fields("ollama", {"options": {"num_ctx": 4096}}) == {
        "options": {"num_ctx": 4096}
    }
    assert native_fields("openai", {"thinking": 1}) == {}


@pytest.mark.parametrize(
    ("body", "endpoint", "expected"),
    [
        ({"temperature": 0}, "chat", True),
        ({"temperature": 0.0}, "chat", True),
        ({"temperature": 0.7}, "chat", False),
        ({"temperature": 0.7, "seed": 3}, "chat", True),
        ({}, "chat", False),
        ({"temperature": False}, "chat", False),
        ({}, "embeddings", True),
    ],
)
def test_deterministic_requests(
    body: dict[str, Any], endpoint: str, expected: bool
) -> None:
    assert is_deterministic(body, endpoint) is expected


def live_chunks() -> list[dict[str, Any]]:
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "Hello "}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "there"}}]},
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "t1",
                                "function": {"name": "f", "arguments": '{"a"'},
                            }
                        ]
                    },
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]
                    },
                }
            ],
        },
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
    ]


def test_a_stream_is_put_together_and_replayed_the_same() -> None:
    collector = ReplyCollector(1000)
    for chunk in live_chunks():
        collector.add(chunk)
    reply = collector.reply()
    assert reply is not None
    message = reply["choices"][0]["message"]
    assert message["content"] == "Hello there"
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a":1}'}
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    replayed = ReplyCollector(1000)
    chunks = list(replay_chunks(reply, usage))
    for chunk in chunks:
        replayed.add(chunk)
    again = replayed.reply()
    assert again is not None
    assert again["choices"] == reply["choices"]
    assert chunks[-1] == {**chunks[-1], "choices": [], "usage": usage}
    writer = ChatStreamWriter(wants_usage=False)
    wire = b"".join(b"".join(writer.feed(c)) for c in chunks) + b"".join(
        writer.finish()
    )
    assert b'"usage"' not in wire and wire.endswith(b"data: [DONE]\n\n")


def test_a_long_answer_is_replayed_in_many_chunks() -> None:
    reply = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "word " * 100},
                "finish_reason": "stop",
            }
        ]
    }
    pieces = [
        c["choices"][0]["delta"].get("content")
        for c in replay_chunks(reply, {})
        if c["choices"]
    ]
    text = [p for p in pieces if p]
    assert len(text) > 10
    assert "".join(text) == "word " * 100


def test_an_incomplete_or_too_large_stream_is_not_kept() -> None:
    unfinished = ReplyCollector(1000)
    for chunk in live_chunks()[:3]:
        unfinished.add(chunk)
    assert unfinished.reply() is None
    small = ReplyCollector(5)
    for chunk in live_chunks():
        small.add(chunk)
    assert small.too_large and small.reply() is None


def test_entries_survive_encoding_and_bad_bytes_are_none() -> None:
    entry = Entry("m", "chat", 12.5, 3, 4, orjson.dumps({"choices": []}))
    assert Entry.decode(entry.encode()) == entry
    assert entry.usage == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
    }
    assert Entry.decode(b"garbage") is None
    assert Entry.decode(b"{}\n{}") is None


def test_the_memory_store_is_bounded_in_bytes_and_least_recently_used() -> None:
    async def scenario() -> None:
        value = b"x" * 100
        size = len("k0") + len(value) + ENTRY_OVERHEAD
        store = MemoryStore(max_bytes=3 * size)
        for n in range(3):
            await store.put(f"k{n}", value, 60)
        assert await store.get("k0") == value  # k0 is now the most recent
        await store.put("k3", value, 60)
        assert await store.get("k1") is None  # the least recently used went
        assert await store.get("k0") == value
        assert store.bytes <= store.max_bytes and len(store) == 3
        await store.put("big", b"y" * (4 * size), 60)
        assert await store.get("big") is None  # over the whole bound
        await store.put("gone", value, 0.0001)
        await asyncio.sleep(0.01)
        assert await store.get("gone") is None

    asyncio.run(scenario())


def test_memory_purges_match_model_and_scope_tags() -> None:
    async def scenario() -> None:
        store = MemoryStore(max_bytes=1 << 20)
        for model in ("m1", "m2"):
            for scope in ("a", ""):
                await store.put(entry_key(model, scope, "d"), b"v", 60)
        from gateway.cache.service import tag

        assert await store.purge(tag("m1"), "") == 2
        assert await store.purge("", tag("a")) == 1
        assert len(store) == 1  # m2, shared

    asyncio.run(scenario())


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs Redis")
def test_the_redis_store_keeps_its_own_byte_cap_least_recently_used_first() -> None:
    import redis

    from tests.conftest import spare_redis_url

    url = spare_redis_url()
    client = redis.Redis.from_url(url)

    def forget() -> None:
        keys = list(client.scan_iter("nexus:{cache}:*"))
        if keys:
            client.delete(*keys)

    value = b"v" * 1000
    size = len(value) + ENTRY_OVERHEAD

    async def scenario() -> None:
        store = RedisStore(url, max_bytes=3 * size, timeout=5)
        try:
            for name in ("m1:a:1", "m1:a:2", "m2:a:3"):
                await store.put(name, value, 60)
                await asyncio.sleep(0.002)  # distinct last-use times
            assert await store.get("m1:a:1") == value  # used: now the newest
            await asyncio.sleep(0.002)
            await store.put("m2:shared:4", value, 60)
            assert await store.get("m1:a:2") is None  # least recently used
            assert await store.get("m1:a:1") == value
            assert await store.used_bytes() == 3 * size
            assert await store.purge("m1", "") == 1
            assert await store.purge("", "a") == 1  # m2:a:3
            assert await store.get("m2:shared:4") == value
            assert await store.used_bytes() == size
            await store.put("m2:shared:5", value, 0.05)
            await asyncio.sleep(0.1)
            assert await store.get("m2:shared:5") is None  # its TTL
        finally:
            await store.close()

    forget()
    try:
        asyncio.run(scenario())
    finally:
        forget()
