"""The mock's prompt cache (--prefix-block-chars): what a model server skips.

A model server with prefix caching (vLLM, SGLang, llama.cpp's cache_prompt)
does not compute again the leading blocks of a prompt it computed recently.
The mock keeps the chained hashes of the prompt blocks it computed (block i's
hash covers blocks 0..i) in an LRU of ``prefix_cache_blocks``; a request's
leading blocks found there are hits, the others are computed at
``prefix_block_ms`` each (a partial last block counts as one). The prompt is
read from a chat body the way a chat template lays it out: tools, then each
message's role and text in order.
"""

from __future__ import annotations

import json
from collections import OrderedDict, deque
from typing import Any

# Requests whose hits /_mock/stats lists by their x-request-id, newest kept.
RECENT_REQUESTS = 10_000


class PrefixCache:
    """The blocks computed lately, oldest first, and the hit counts."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.hits = 0
        self.queries = 0
        self.recent: deque[tuple[str, int, int]] = deque(maxlen=RECENT_REQUESTS)

    def compute(
        self,
        body: bytes,
        block_chars: int,
        capacity: int,
        request_id: str | None = None,
    ) -> tuple[int, int]:
        """Take the request's prompt; return its blocks found in the cache and
        its blocks."""
        text = _prompt_of(body)
        if not text:
            return 0, 0
        total = -(-len(text) // block_chars)
        keys: list[int] = []
        previous = 0
        for start in range(0, len(text), block_chars):
            previous = hash((previous, text[start : start + block_chars]))
            keys.append(previous)
        blocks = self._blocks
        hits = 0
        for key in keys:
            if key not in blocks:
                break
            hits += 1
        # The last block first, so the head of a prompt outlives its tail.
        for key in reversed(keys):
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
        while len(blocks) > capacity:
            blocks.popitem(last=False)
        self.hits += hits
        self.queries += total
        if request_id is not None:
            self.recent.append((request_id, hits, total))
        return hits, total

    def vllm_metrics(self, config: Any) -> bytes:
        """vLLM's /metrics for this cache: its prefix cache counters (prompt
        tokens at 4 characters a token) and its size as cache_config_info."""
        tokens_a_block = max(config.prefix_block_chars // 4, 1)
        model = config.models[0]
        labels = f'{{model_name="{model}"}}'
        queries = float(self.queries * tokens_a_block)
        hits = float(self.hits * tokens_a_block)
        size = f'block_size="{tokens_a_block}",num_gpu_blocks="{config.prefix_cache_blocks}"'
        lines = [
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total{labels} {queries}",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{labels} {hits}",
            "# TYPE vllm:cache_config_info gauge",
            f"vllm:cache_config_info{{{size}}} 1.0",
        ]
        if config.kv_cache_usage is not None:
            lines.append(
                f'vllm:gpu_cache_usage_perc{{model_name="{model}"}} '
                f"{config.kv_cache_usage}"
            )
        return ("\n".join(lines) + "\n").encode()

    def reset(self) -> None:
        """Forget every block and zero the counts."""
        self._blocks.clear()
        self.hits = 0
        self.queries = 0
        self.recent.clear()

    def as_dict(self) -> dict[str, Any]:
        """The counts /_mock/stats shows."""
        return {
            "prefix_cache_hits": self.hits,
            "prefix_cache_queries": self.queries,
            "prefix_cache_blocks": len(self._blocks),
            # x-request-id -> [blocks found, blocks] of the latest requests.
            "prefix_requests": {rid: [hits, total] for rid, hits, total in self.recent},
        }


def _prompt_of(body: bytes) -> str:
    try:
        payload = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(payload, dict):
        return ""
    parts: list[str] = []
    tools = payload.get("tools")
    if tools:
        parts.append(json.dumps(tools, sort_keys=True))
    system = payload.get("system")  # Anthropic's Messages
    if system:
        parts.append(json.dumps(system))
    messages = payload.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                parts.append(
                    f"{message.get('role')}:{json.dumps(message.get('content'))}"
                )
    elif isinstance(payload.get("prompt"), str):
        parts.append(payload["prompt"])
    return "\n".join(parts)
