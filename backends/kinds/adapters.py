"""The adapter of each backend kind (see the package docstring for what each asks)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import httpx

from backends.kinds.base import (
    MAX_PROPS_ANSWER,
    MAX_VERSION_ANSWER,
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
    model_entries,
    positive_int,
    version_in,
)

ANTHROPIC_VERSION = "2023-06-01"
# vLLM's KV cache this full (0..1) is memory pressure: new requests wait or
# preempt running ones there.
PRESSURE_KV_USAGE = 0.95
# Bytes of vLLM's /metrics read at most (a few hundred lines of Prometheus text).
MAX_METRICS_ANSWER = 512 * 1024
_KV_USAGE = re.compile(
    r"^vllm:(?:gpu_cache_usage_perc|kv_cache_usage_perc)(?:\{[^}]*\})? "
    r"([0-9.eE+-]+)\s*$",
    re.MULTILINE,
)
# vLLM's prefix cache counters (prompt tokens) and its cache's configuration.
_PREFIX_COUNTER = re.compile(
    r"^vllm:(?:gpu_)?prefix_cache_(hits|queries)(?:_total)?(?:\{[^}]*\})? "
    r"([0-9.eE+]+)\s*$",
    re.MULTILINE,
)
_CACHE_CONFIG = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
# The largest prompt cache believed (tokens; more is a broken answer).
MAX_CACHE_TOKENS = 10**10
# The most slots a server is believed to report (more is a broken answer).
MAX_SLOTS = 4096
_NUM_CTX = re.compile(r"^\s*num_ctx\s+(\d+)\s*$", re.MULTILINE)
_LONG_FRACTION = re.compile(r"(\.\d+)")


class OpenAIKind(BackendKindAdapter):
    kind = "openai"


class VLLMKind(BackendKindAdapter):
    kind = "vllm"
    server_json_mode = True
    lists_loaded_models = True

    async def probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> ProbeResult:
        response, latency = await self._request(client, endpoint, "GET", "/health")
        self._check_status(response, "GET", "/health")
        # /health proves the engine is alive; /v1/models that the key works.
        await self._get_json(client, endpoint, "/v1/models")
        memory, prefix_cache = await self._read_metrics(client, endpoint)
        return ProbeResult(
            ProbeStatus.UP,
            latency_ms=latency,
            memory=memory,
            prefix_cache=prefix_cache,
        )

    async def _read_metrics(
        self, client: httpx.AsyncClient, endpoint: Endpoint
    ) -> tuple[MemoryReport | None, PrefixCacheReport | None]:
        """The KV cache usage of ``/metrics`` as memory pressure, and its
        prefix cache counters and size (None: unread)."""
        try:
            text = await self._get_small_text(
                client, endpoint, "/metrics", MAX_METRICS_ANSWER
            )
        except (ProbeFailed, httpx.HTTPError):
            return None, None  # metrics disabled or behind another path
        usages = [float(found) for found in _KV_USAGE.findall(text)]
        usage = max((u for u in usages if 0.0 <= u <= 1.0), default=None)
        memory = None
        if usage is not None:
            memory = MemoryReport(pressure=usage >= PRESSURE_KV_USAGE)
        return memory, read_vllm_prefix_cache(text)

    async def read_version(self, client: httpx.AsyncClient, endpoint: Endpoint) -> str:
        """``GET /version``: ``{"version": "0.8.5"}``."""
        payload = await self._get_small_json(
            client, endpoint, "/version", MAX_VERSION_ANSWER
        )
        return version_in(payload, "version", "/version")


class LlamaCppKind(BackendKindAdapter):
    kind = "llamacpp"
    server_json_mode = True
    lists_loaded_models = True

    async def probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> ProbeResult:
        response, latency = await self._request(client, endpoint, "GET", "/health")
        if _is_loading(response):
            return ProbeResult(
                ProbeStatus.LOADING,
                latency_ms=latency,
                error="loading its model (HTTP 503 from GET /health)",
            )
        self._check_status(response, "GET", "/health")
        version, slots, n_ctx = await self._read_slots(client, endpoint)
        cache = None
        if slots is not None and n_ctx is not None:
            # Each slot keeps its last prompt (cache_prompt): n_ctx tokens each.
            cache = PrefixCacheReport(cache_tokens=min(slots * n_ctx, MAX_CACHE_TOKENS))
        return ProbeResult(
            ProbeStatus.UP,
            latency_ms=latency,
            version=version,
            memory=None if slots is None else MemoryReport(slots=slots),
            prefix_cache=cache,
        )

    async def _read_slots(
        self, client: httpx.AsyncClient, endpoint: Endpoint
    ) -> tuple[str | None, int | None, int | None]:
        """The version, slot count and context per slot of ``/props``
        (``/slots`` for the count when /props lacks it); None where it could
        not be read."""
        try:
            props = await self._get_small_json(
                client, endpoint, "/props", MAX_PROPS_ANSWER
            )
        except (ProbeFailed, httpx.HTTPError):
            return None, None, None
        if not isinstance(props, dict):
            return None, None, None
        version = version_in(props, "build_info", "/props")
        settings = props.get("default_generation_settings")
        n_ctx = (
            positive_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
        )
        slots = positive_int(props.get("total_slots"))
        if slots is None:
            try:
                listed = await self._get_small_json(
                    client, endpoint, "/slots", MAX_PROPS_ANSWER
                )
            except (ProbeFailed, httpx.HTTPError):
                listed = None
            slots = len(listed) if isinstance(listed, list) and listed else None
        if slots is not None and slots > MAX_SLOTS:
            slots = None
        return version, slots, n_ctx

    async def read_version(self, client: httpx.AsyncClient, endpoint: Endpoint) -> str:
        """``GET /props``: its ``build_info`` ("b5000-1b2c3d4"); "" on builds
        that do not say (the probe reads it already)."""
        payload = await self._get_small_json(
            client, endpoint, "/props", MAX_PROPS_ANSWER
        )
        return version_in(payload, "build_info", "/props")

    async def list_models(
        self, client: httpx.AsyncClient, endpoint: Endpoint
    ) -> list[ModelInfo]:
        response, _ = await self._request(client, endpoint, "GET", "/v1/models")
        if _is_loading(response):
            raise BackendLoading("still loading its model; try again shortly")
        self._check_status(response, "GET", "/v1/models")
        try:
            entries = model_entries(response.json(), "/v1/models")
        except ValueError:
            raise ProbeFailed("GET /v1/models did not answer JSON") from None
        props = await self._props(client, endpoint)
        single = len(entries) == 1
        models = []
        for entry in entries:
            meta = entry.get("meta")
            trained = (
                positive_int(meta.get("n_ctx_train"))
                if isinstance(meta, dict)
                else None
            )
            context = trained
            vision = tools = None
            # /props describes the server's one model; with several it is unclear
            # which one, so only the per-model metadata is used then.
            if single and props:
                settings = props.get("default_generation_settings")
                n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
                context = positive_int(n_ctx) or positive_int(props.get("n_ctx"))
                context = context or trained
                vision = _nested_bool(props, "modalities", "vision")
                tools = _nested_bool(props, "chat_template_caps", "supports_tools")
            models.append(
                ModelInfo(
                    name=entry["id"],
                    context_length=context,
                    supports_vision=vision,
                    supports_tools=tools,
                    supports_json_mode=True,
                    loaded=True,
                )
            )
        return models

    async def _props(
        self, client: httpx.AsyncClient, endpoint: Endpoint
    ) -> dict[str, Any]:
        # Older servers lack /props, and --api-key protects it on some builds:
        # discovery still works from /v1/models alone.
        try:
            props, _ = await self._get_json(client, endpoint, "/props")
        except ProbeFailed:
            return {}
        return props if isinstance(props, dict) else {}


# /api/show requests one discovery run has open at once, per backend. It runs
# only in discovery (every few minutes), never in a health round.
SHOW_CONCURRENCY = 8

_Shown = tuple[int | None, bool | None, bool | None, float | None, int | None]
_UNKNOWN: _Shown = (None, None, None, None, None)
# Bytes of one cached key or value element (Ollama's default f16 KV cache).
KV_ELEMENT_BYTES = 2


class OllamaKind(BackendKindAdapter):
    kind = "ollama"
    server_json_mode = True

    async def probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> ProbeResult:
        payload, latency = await self._get_json(client, endpoint, "/api/ps")
        names = _ollama_names(payload, "/api/ps")
        details = _ollama_loaded(payload, names)
        return ProbeResult(
            ProbeStatus.UP,
            latency_ms=latency,
            loaded_models=frozenset(names),
            loaded_details=details,
            memory=MemoryReport(
                used_bytes=sum(d.vram_bytes or 0 for d in details.values())
            ),
        )

    async def read_version(self, client: httpx.AsyncClient, endpoint: Endpoint) -> str:
        """``GET /api/version``: ``{"version": "0.6.8"}``."""
        payload = await self._get_small_json(
            client, endpoint, "/api/version", MAX_VERSION_ANSWER
        )
        return version_in(payload, "version", "/api/version")

    async def list_models(
        self, client: httpx.AsyncClient, endpoint: Endpoint
    ) -> list[ModelInfo]:
        tags, _ = await self._get_json(client, endpoint, "/api/tags")
        names = _ollama_names(tags, "/api/tags")
        sizes = _ollama_field(tags, "size")
        ps, _ = await self._get_json(client, endpoint, "/api/ps")
        loaded = set(_ollama_names(ps, "/api/ps"))
        limit = asyncio.Semaphore(SHOW_CONCURRENCY)
        shown = await asyncio.gather(
            *(self._show_limited(client, endpoint, name, limit) for name in names)
        )
        return [
            ModelInfo(
                name=name,
                context_length=context,
                supports_vision=vision,
                supports_tools=tools,
                supports_json_mode=True,
                loaded=name in loaded,
                size_bytes=_byte_count(sizes.get(name)),
                parameters_b=billions,
                kv_bytes_per_token=kv,
            )
            for name, (context, vision, tools, billions, kv) in zip(
                names, shown, strict=True
            )
        ]

    async def _show_limited(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        name: str,
        limit: asyncio.Semaphore,
    ) -> _Shown:
        async with limit:
            shown = await self._show(client, endpoint, name)
        return _UNKNOWN if shown is None else shown

    async def _show(
        self, client: httpx.AsyncClient, endpoint: Endpoint, name: str
    ) -> _Shown | None:
        """Return (context length, vision, tools, parameters in billions, KV
        bytes per token) of one model, None where unknown; None when /api/show
        failed (not cached)."""
        try:
            info, _ = await self._get_json(
                client, endpoint, "/api/show", method="POST", body={"model": name}
            )
        except ProbeFailed:
            # One broken manifest should not hide the backend's other models.
            return None
        if not isinstance(info, dict):
            return None
        details = info.get("details")
        size_text = details.get("parameter_size") if isinstance(details, dict) else None
        billions = (
            parse_parameter_size(size_text) if isinstance(size_text, str) else None
        )
        context = None
        parameters = info.get("parameters")
        if isinstance(parameters, str):
            match = _NUM_CTX.search(parameters)
            context = positive_int(int(match.group(1))) if match else None
        model_info = info.get("model_info")
        if context is None and isinstance(model_info, dict):
            for key, value in model_info.items():
                if key.endswith(".context_length"):
                    context = positive_int(value)
                    break
        kv = kv_bytes_per_token(model_info) if isinstance(model_info, dict) else None
        capabilities = info.get("capabilities")
        if isinstance(capabilities, list):
            vision = "vision" in capabilities
            return context, vision, "tools" in capabilities, billions, kv
        # Before Ollama listed capabilities, a vision model had a projector.
        vision_or_none = True if info.get("projector_info") else None
        return context, vision_or_none, None, billions, kv


class AnthropicKind(BackendKindAdapter):
    kind = "anthropic"
    discovers_models = False

    def headers(self, endpoint: Endpoint) -> dict[str, str]:
        return {"x-api-key": endpoint.api_key, "anthropic-version": ANTHROPIC_VERSION}

    async def probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> ProbeResult:
        if not endpoint.api_key:
            raise ProbeFailed("no API key set; Anthropic needs one")
        _, latency = await self._get_json(client, endpoint, "/v1/models?limit=1")
        return ProbeResult(ProbeStatus.UP, latency_ms=latency)

    async def list_models(
        self, client: httpx.AsyncClient, endpoint: Endpoint
    ) -> list[ModelInfo]:
        raise ProbeFailed("Anthropic backends list their models in the configuration")


class RelayKind(BackendKindAdapter):
    """A worker behind NAT (backends/workers.py): nothing to dial.

    Its health comes from heartbeats and its models from its register and
    models_update messages, so health rounds and discovery skip it
    (``BackendQuerySet.endpoints``); asked anyway, it says so.
    """

    kind = "relay"
    discovers_models = False

    async def probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> ProbeResult:
        raise ProbeFailed("relay workers report their health by heartbeats")

    async def list_models(
        self, client: httpx.AsyncClient, endpoint: Endpoint
    ) -> list[ModelInfo]:
        raise ProbeFailed("relay workers advertise their models when they connect")


def read_vllm_prefix_cache(text: str) -> PrefixCacheReport | None:
    """vLLM's prefix cache counters and size in ``/metrics`` text (None: none).

    Counters are summed over their label sets (one per model or engine); the
    size is ``num_gpu_blocks`` x ``block_size`` of ``vllm:cache_config_info``.
    """
    totals: dict[str, float] = {}
    for name, value in _PREFIX_COUNTER.findall(text):
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    tokens = None
    config = _CACHE_CONFIG.search(text)
    if config is not None:
        labels = dict(_LABEL.findall(config.group(1)))
        blocks = positive_int(_int_or_none(labels.get("num_gpu_blocks")))
        size = positive_int(_int_or_none(labels.get("block_size")))
        if blocks is not None and size is not None:
            tokens = blocks * size if blocks * size <= MAX_CACHE_TOKENS else None
    hits, queries = totals.get("hits"), totals.get("queries")
    if hits is None and queries is None and tokens is None:
        return None
    return PrefixCacheReport(
        hits=None if hits is None else int(hits),
        queries=None if queries is None else int(queries),
        cache_tokens=tokens,
    )


def _int_or_none(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _is_loading(response: httpx.Response) -> bool:
    if response.status_code != 503:
        return False
    try:
        payload = response.json()
    except ValueError:
        return False
    error = payload.get("error") if isinstance(payload, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return isinstance(message, str) and "loading" in message.lower()


def _ollama_names(payload: Any, path: str) -> list[str]:
    models = payload.get("models") if isinstance(payload, dict) else None
    if not isinstance(models, list):
        raise ProbeFailed(f"GET {path} did not answer a model list")
    names: list[str] = []
    for entry in models:
        if not isinstance(entry, dict):
            continue
        name = entry.get("name") or entry.get("model")
        if isinstance(name, str) and name and name not in names:
            names.append(name)
    return names


def _ollama_field(payload: Any, key: str) -> dict[str, Any]:
    """Each listed model's `key` value, by name (a list already checked)."""
    values: dict[str, Any] = {}
    for entry in payload["models"]:
        if isinstance(entry, dict):
            name = entry.get("name") or entry.get("model")
            if isinstance(name, str) and name not in values:
                values[name] = entry.get(key)
    return values


def _ollama_loaded(payload: Any, names: list[str]) -> dict[str, LoadedModel]:
    """What /api/ps says of each loaded model: memory, context, keep_alive expiry."""
    vram = _ollama_field(payload, "size_vram")
    context = _ollama_field(payload, "context_length")
    expires = _ollama_field(payload, "expires_at")
    return {
        name: LoadedModel(
            vram_bytes=_byte_count(vram.get(name)),
            context_length=positive_int(context.get(name)),
            expires_at=parse_expiry(expires.get(name)),
        )
        for name in names
    }


def _byte_count(value: Any) -> int | None:
    """A size in bytes (up to 1 PB), or None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 < value <= 10**15 else None


def parse_expiry(value: Any) -> datetime | None:
    """Ollama's ``expires_at`` (RFC 3339, up to nanoseconds) as an aware datetime.

    None for anything unparseable, and for years before 2000 (Ollama's zero
    time) or after 9000 (keep_alive -1 means "never"; the model stays hot).
    """
    if not isinstance(value, str) or len(value) > 64:
        return None
    # Python parses at most microseconds: cut longer fractions to six digits.
    text = _LONG_FRACTION.sub(lambda m: m.group(1)[:7], value.strip())
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    if parsed.tzinfo is None or not 2000 <= parsed.year <= 9000:
        return None
    return parsed


def kv_bytes_per_token(model_info: Mapping[str, Any]) -> int | None:
    """The KV cache one token takes, from /api/show's ``model_info``.

    Layers x KV heads x (key + value length) x KV_ELEMENT_BYTES, the
    architecture's keys (``llama.block_count``, ``llama.attention.head_count_kv``,
    ``llama.attention.key_length``; a head's length is the embedding length
    over the head count when not given). None when one is missing.
    """
    arch = model_info.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        return None

    def number(key: str) -> int | None:
        return positive_int(model_info.get(f"{arch}.{key}"))

    layers = number("block_count")
    heads = number("attention.head_count")
    kv_heads = number("attention.head_count_kv") or heads
    width = number("embedding_length")
    head = width // heads if width and heads else None
    key = number("attention.key_length") or head
    value = number("attention.value_length") or head
    if layers is None or kv_heads is None or key is None or value is None:
        return None
    return layers * kv_heads * (key + value) * KV_ELEMENT_BYTES


def parse_parameter_size(text: str) -> float | None:
    """Billions of parameters in Ollama's ``parameter_size`` ("70.6B", "137M")."""
    units = {"K": 1e-6, "M": 1e-3, "B": 1.0, "T": 1e3}
    cleaned = text.strip().upper()
    if not 2 <= len(cleaned) <= 16 or cleaned[-1] not in units:
        return None
    try:
        value = float(cleaned[:-1])
    except ValueError:
        return None
    if not 0 < value < 1e6:  # also rejects nan and inf
        return None
    return value * units[cleaned[-1]]


def _nested_bool(payload: Mapping[str, Any], outer: str, inner: str) -> bool | None:
    section = payload.get(outer)
    value = section.get(inner) if isinstance(section, dict) else None
    return value if isinstance(value, bool) else None
