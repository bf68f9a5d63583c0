"""How to probe and list the models of each kind of backend: one adapter per kind.

``KINDS`` maps a ``BackendKind`` value to its adapter, as healthchecks maps a
channel kind to its transport. Adapters are stateless async code over a shared
``httpx.AsyncClient``; they know URLs, headers and response shapes and nothing
about the database, so the health checker, discovery and (later) the proxy can
all use them. Every message they produce is short and safe to store and show:
it never includes the API key, a response body or the backend's URL.

What each kind is asked:

- ``openai``: ``GET /v1/models`` with the key as a bearer token. Context length
  is taken from the model entries when the server adds it (``max_model_len``,
  ``context_length``, ``context_window``, ``max_context_length``).
- ``vllm``: ``GET /health``, then ``/v1/models`` (context from ``max_model_len``),
  then ``/metrics`` (``vllm:gpu_cache_usage_perc``, or ``kv_cache_usage_perc``
  on newer servers: at PRESSURE_KV_USAGE or above the node reports memory
  pressure; a server without metrics says nothing).
- ``ollama``: ``GET /api/ps`` to probe (it also says which models are loaded,
  with ``size_vram``, ``context_length`` and the keep_alive ``expires_at``; the
  ``size_vram`` sum over every loaded model is the memory in use);
  discovery adds ``GET /api/tags`` (installed models and their ``size``) and
  ``POST /api/show`` per model (context length: the model's ``num_ctx``
  parameter if set, else its trained ``*.context_length``; vision and tools
  from ``capabilities``; ``details.parameter_size``; the KV cache per token
  from the architecture's ``block_count``, ``attention.head_count_kv`` and key
  and value lengths). /api/show runs only in discovery (every few minutes),
  never in a health round.
- ``llamacpp``: ``GET /health``, where ``503 Loading model`` is a loading state
  rather than a failure, then ``/props`` (``total_slots``, and ``build_info`` as
  the version; the slot count from ``/slots`` when /props lacks it); discovery
  reads ``/v1/models`` and ``/props`` (the slot's ``n_ctx``,
  ``modalities.vision``, ``chat_template_caps.supports_tools``).
- ``anthropic``: ``GET /v1/models?limit=1`` with ``x-api-key``, the cheapest
  authenticated request; its models come from configuration, not discovery.
- ``relay``: a worker behind NAT that dialled in; not asked anything (its
  heartbeats are its health, its register message lists its models).

After a good probe the health round also reads the server's version
(``read_version()``): Ollama ``GET /api/version``, llama.cpp ``GET /props``
(``build_info``), vLLM ``GET /version``; OpenAI-compatible, Anthropic and relay
backends do not say (""). The answer is read up to a few kilobytes (/props: 512
KiB, it carries the chat template), uncompressed, and within what is left of
the probe's time; a failure to read it keeps the version recorded before and
never fails the probe.

Ollama, vLLM and llama.cpp constrain output to JSON for any model they serve,
so their models are reported with JSON mode; elsewhere it is left unknown.
"""

from __future__ import annotations

from backends.kinds.adapters import (
    AnthropicKind,
    LlamaCppKind,
    OllamaKind,
    OpenAIKind,
    RelayKind,
    VLLMKind,
)
from backends.kinds.base import (
    MAX_MESSAGE,
    MAX_VERSION,
    BackendKindAdapter,
    BackendLoading,
    Endpoint,
    LoadedModel,
    MemoryReport,
    ModelInfo,
    PrefixCacheReport,
    ProbeFailed,
    ProbeResult,
    ProbeStatus,
    describe_error,
)

KINDS: dict[str, BackendKindAdapter] = {
    adapter.kind: adapter
    for adapter in (
        OpenAIKind(),
        VLLMKind(),
        LlamaCppKind(),
        OllamaKind(),
        AnthropicKind(),
        RelayKind(),
    )
}


def get_adapter(kind: str) -> BackendKindAdapter:
    """Return the adapter of a backend kind; raise KeyError for an unknown kind."""
    return KINDS[kind]


__all__ = [
    "KINDS",
    "MAX_MESSAGE",
    "MAX_VERSION",
    "BackendKindAdapter",
    "BackendLoading",
    "Endpoint",
    "LoadedModel",
    "MemoryReport",
    "ModelInfo",
    "PrefixCacheReport",
    "ProbeFailed",
    "ProbeResult",
    "ProbeStatus",
    "describe_error",
    "get_adapter",
]
