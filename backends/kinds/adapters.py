"""The adapter of each backend kind (see the package docstring for what each asks)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

import httpx

from backends.kinds.base import (
    BackendKindAdapter,
    BackendLoading,
    Endpoint,
    ModelInfo,
    ProbeFailed,
    ProbeResult,
    ProbeStatus,
    model_entries,
    positive_int,
)

ANTHROPIC_VERSION = "2023-06-01"
_NUM_CTX = re.compile(r"^\s*num_ctx\s+(\d+)\s*$", re.MULTILINE)


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
        return ProbeResult(ProbeStatus.UP, latency_ms=latency)


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
        return ProbeResult(ProbeStatus.UP, latency_ms=latency)

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


class OllamaKind(BackendKindAdapter):
    kind = "ollama"
    server_json_mode = True

    async def probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> ProbeResult:
        payload, latency = await self._get_json(client, endpoint, "/api/ps")
        return ProbeResult(
            ProbeStatus.UP,
            latency_ms=latency,
            loaded_models=frozenset(_ollama_names(payload, "/api/ps")),
        )

    async def list_models(
        self, client: httpx.AsyncClient, endpoint: Endpoint
    ) -> list[ModelInfo]:
        tags, _ = await self._get_json(client, endpoint, "/api/tags")
        names = _ollama_names(tags, "/api/tags")
        ps, _ = await self._get_json(client, endpoint, "/api/ps")
        loaded = set(_ollama_names(ps, "/api/ps"))
        shown = await asyncio.gather(
            *(self._show(client, endpoint, name) for name in names)
        )
        return [
            ModelInfo(
                name=name,
                context_length=context,
                supports_vision=vision,
                supports_tools=tools,
                supports_json_mode=True,
                loaded=name in loaded,
            )
            for name, (context, vision, tools) in zip(names, shown, strict=True)
        ]

    async def _show(
        self, client: httpx.AsyncClient, endpoint: Endpoint, name: str
    ) -> tuple[int | None, bool | None, bool | None]:
        """Return (context length, vision, tools) of one model, None where unknown."""
        try:
            info, _ = await self._get_json(
                client, endpoint, "/api/show", method="POST", body={"model": name}
            )
        except ProbeFailed:
            # One broken manifest should not hide the backend's other models.
            return None, None, None
        if not isinstance(info, dict):
            return None, None, None
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
        capabilities = info.get("capabilities")
        if isinstance(capabilities, list):
            return context, "vision" in capabilities, "tools" in capabilities
        # Before Ollama listed capabilities, a vision model had a projector.
        vision = True if info.get("projector_info") else None
        return context, vision, None


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


def _nested_bool(payload: Mapping[str, Any], outer: str, inner: str) -> bool | None:
    section = payload.get(outer)
    value = section.get(inner) if isinstance(section, dict) else None
    return value if isinstance(value, bool) else None
