"""The probe endpoints of the servers the mock can imitate (``kind`` knob).

Every kind keeps the OpenAI-compatible ``/v1`` API of
``nexus_mock.answers`` except ``anthropic``, and adds what Nexus's
health checks and model discovery ask that kind of server, in its own wire
format:

- ``ollama``: ``GET /api/tags`` (every model), ``GET /api/ps`` (the
  ``loaded_models``, all when unset, each with ``context_length``),
  ``POST /api/show`` (``{"model": name}``: ``model_info`` with
  ``llama.context_length``, ``capabilities`` with ``vision`` / ``tools`` for the
  ``vision_models`` / ``tool_models``), ``GET /api/version``, and the native
  inference API of ``nexus_mock.ollama_api`` (``/api/chat``,
  ``/api/generate``, ``/api/embed``, ``/api/embeddings``). Errors are
  ``{"error": "..."}``.

The version each kind reports (Ollama ``/api/version``, vLLM ``/version``,
llama.cpp ``build_info`` in ``/props``) is ``server_version`` (``--version``),
else a recent release.
- ``vllm``: ``GET /health`` (200, empty body, never authenticated), ``GET
  /version``, ``max_model_len`` on every ``/v1/models`` entry, and, with
  ``kv_cache_usage`` set, ``GET /metrics`` with ``vllm:gpu_cache_usage_perc``.
- ``llamacpp``: ``GET /health`` (``{"status": "ok"}``, never authenticated),
  ``GET /props`` (the first model's slot ``n_ctx``, ``modalities.vision``,
  ``chat_template_caps.supports_tools``, ``total_slots``: ``slots``, at least
  1), ``GET /slots`` (one entry per slot) and ``meta.n_ctx_train`` (four times
  ``context_length``) on ``/v1/models`` entries. With ``loading`` on, every path
  answers 503 ``{"error": {"code": 503, "message": "Loading model", "type":
  "unavailable_error"}}``, as llama.cpp does while it loads.
- ``anthropic``: ``GET /v1/models`` in Anthropic's shape, and ``POST
  /v1/messages`` (+ ``count_tokens``, see ``nexus_mock.messages``);
  ``api_key`` is checked in ``x-api-key`` and ``anthropic-version`` is
  required. Anything else is a 404 in Anthropic's error shape.

``context_length`` is what each kind reports as the model's context window.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

from nexus_mock.config import MockConfig
from nexus_mock.http_parsing import Request
from nexus_mock.jobs import ApiError, parse_json_object
from nexus_mock.replies import encode_json

OLLAMA_VERSION = "0.6.8"
VLLM_VERSION = "0.8.5"
LLAMACPP_BUILD = "b5000-mock"
# Bytes of a 4-bit 8B model, give or take: only there to look like Ollama.
_MODEL_SIZE = 4_661_224_676


def answer_kind_request(
    request: Request, config: MockConfig, started: int
) -> bytes | None:
    """Answer a request only this kind of server has; None lets /v1 handle it.

    Raises ApiError for errors, including authentication on these paths.
    """
    kind = config.kind
    if kind == "llamacpp":
        return _answer_llamacpp(request, config)
    if kind == "ollama":
        return _answer_ollama(request, config)
    if kind == "vllm":
        return _answer_vllm(request, config)
    if kind == "anthropic":
        return _answer_anthropic(request, config, started)
    return None


def describe_model(config: MockConfig, model: str, created: int) -> dict[str, Any]:
    """Return a /v1/models entry as this kind of server writes it."""
    entry: dict[str, Any] = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": config.name,
    }
    if config.kind == "vllm":
        entry.update(
            owned_by="vllm",
            root=model,
            parent=None,
            max_model_len=config.context_length,
        )
    elif config.kind == "llamacpp":
        entry.update(
            owned_by="llamacpp",
            meta={
                "vocab_type": 2,
                "n_vocab": 128256,
                "n_ctx_train": config.context_length * 4,
                "n_embd": 4096,
                "n_params": 8_030_261_248,
                "size": _MODEL_SIZE,
            },
        )
    elif config.kind == "anthropic":
        return {
            "type": "model",
            "id": model,
            "display_name": model,
            "created_at": _iso(created),
        }
    return entry


# llama.cpp


def _answer_llamacpp(request: Request, config: MockConfig) -> bytes | None:
    if config.loading:
        raise ApiError(
            503,
            "Loading model",
            body=encode_json(
                {
                    "error": {
                        "code": 503,
                        "message": "Loading model",
                        "type": "unavailable_error",
                    }
                }
            ),
        )
    if request.path == "/health":
        _require_get(request)
        return encode_json({"status": "ok"})
    if request.path == "/props":
        _require_get(request)
        check_bearer(request, config)
        model = config.models[0]
        return encode_json(
            {
                "default_generation_settings": {
                    "id": 0,
                    "n_ctx": config.context_length,
                    "is_processing": False,
                    "params": {"temperature": 0.8, "top_p": 0.95},
                },
                "total_slots": max(config.slots, 1),
                "model_path": f"/models/{model}.gguf",
                "chat_template": "{{ messages }}",
                "modalities": {"vision": model in config.vision_models, "audio": False},
                "chat_template_caps": {"supports_tools": model in config.tool_models},
                "build_info": config.server_version or LLAMACPP_BUILD,
            }
        )
    if request.path == "/slots":
        _require_get(request)
        return encode_json(
            [
                {"id": slot, "n_ctx": config.context_length, "is_processing": False}
                for slot in range(max(config.slots, 1))
            ]
        )
    return None


# vLLM


def _answer_vllm(request: Request, config: MockConfig) -> bytes | None:
    if request.path == "/health":
        _require_get(request)
        return b""
    if request.path == "/version":
        _require_get(request)
        return encode_json({"version": config.server_version or VLLM_VERSION})
    if request.path == "/metrics" and config.kv_cache_usage is not None:
        _require_get(request)
        model = config.models[0]
        return (
            "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 "
            "percent usage.\n# TYPE vllm:gpu_cache_usage_perc gauge\n"
            f'vllm:gpu_cache_usage_perc{{model_name="{model}"}} '
            f"{config.kv_cache_usage}\n"
        ).encode()
    return None


# Ollama


def _answer_ollama(request: Request, config: MockConfig) -> bytes | None:
    path = request.path
    if not path.startswith("/api/"):
        return None
    check_bearer(request, config, ollama=True)
    if path == "/api/version":
        _require_get(request)
        return encode_json({"version": config.server_version or OLLAMA_VERSION})
    if path == "/api/tags":
        _require_get(request)
        return encode_json(
            {"models": [describe_ollama_tag(config, m) for m in config.models]}
        )
    if path == "/api/ps":
        _require_get(request)
        loaded = config.models if config.loaded_models is None else config.loaded_models
        expires = _iso(int(time.time()) + 300)
        return encode_json(
            {
                "models": [
                    {
                        **describe_ollama_tag(config, model),
                        "expires_at": expires,
                        "size_vram": _MODEL_SIZE,
                        "context_length": config.context_length,
                    }
                    for model in loaded
                    if model in config.models
                ]
            }
        )
    if path == "/api/show":
        if request.method != "POST":
            raise _ollama_error(405, "method not allowed")
        return _ollama_show(request, config)
    raise _ollama_error(404, "404 page not found")


def _ollama_show(request: Request, config: MockConfig) -> bytes:
    try:
        payload = parse_json_object(request.body)
    except ApiError:
        raise _ollama_error(400, "invalid request body") from None
    name = payload.get("model") or payload.get("name")
    if not isinstance(name, str) or not name:
        raise _ollama_error(400, "model is required")
    if name not in config.models:
        raise _ollama_error(404, f"model '{name}' not found")
    capabilities = ["completion"]
    if name in config.vision_models:
        capabilities.append("vision")
    if name in config.tool_models:
        capabilities.append("tools")
    return encode_json(
        {
            "license": "mock",
            "modelfile": f"FROM {name}\n",
            "parameters": 'stop "<|eot_id|>"',
            "template": "{{ .Prompt }}",
            "details": _ollama_details(config.size_of(name)),
            "model_info": {
                "general.architecture": "llama",
                "general.parameter_count": 8_030_261_248,
                "llama.context_length": config.context_length,
                "llama.embedding_length": 4096,
                "llama.block_count": 32,
                "llama.attention.head_count": 32,
                "llama.attention.head_count_kv": 8,
            },
            "capabilities": capabilities,
            "modified_at": _iso(int(time.time())),
        }
    )


def describe_ollama_tag(config: MockConfig, model: str) -> dict[str, Any]:
    """A model as Ollama's /api/tags lists it (its size when one was given)."""
    size_gb = config.size_of(model)
    return {
        "name": model,
        "model": model,
        "modified_at": _iso(int(time.time())),
        "size": _MODEL_SIZE if size_gb is None else int(size_gb * 1_000_000_000),
        "digest": hashlib.sha256(model.encode()).hexdigest(),
        "details": _ollama_details(size_gb),
    }


def _ollama_details(size_gb: float | None = None) -> dict[str, Any]:
    # A 4-bit quantised model takes about 0.6 GB per billion parameters.
    parameters = "8.0B" if size_gb is None else f"{size_gb / 0.6:.1f}B"
    return {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": parameters,
        "quantization_level": "Q4_0",
    }


def _ollama_error(status: int, message: str) -> ApiError:
    return ApiError(status, message, body=encode_json({"error": message}))


# Anthropic


def check_anthropic_headers(request: Request, config: MockConfig) -> None:
    """Require the key (when the mock has one) and ``anthropic-version``.

    The key comes as ``x-api-key`` (anthropic < 2) or as a bearer token
    (anthropic 2.x sends ``Authorization: Bearer``; Anthropic takes both).
    """
    if config.api_key is not None:
        bearer = request.headers.get("authorization", "")
        given = request.headers.get("x-api-key", "") or (
            bearer[7:] if bearer[:7].lower() == "bearer " else ""
        )
        if not hmac.compare_digest(given.encode(), config.api_key.encode()):
            raise _anthropic_error(401, "authentication_error", "invalid x-api-key")
    if "anthropic-version" not in request.headers:
        raise _anthropic_error(
            400, "invalid_request_error", "anthropic-version: header is required"
        )


def _answer_anthropic(request: Request, config: MockConfig, started: int) -> bytes:
    check_anthropic_headers(request, config)
    if request.path != "/v1/models":
        raise _anthropic_error(404, "not_found_error", "Not found")
    if request.method != "GET":
        raise _anthropic_error(405, "invalid_request_error", "Method not allowed")
    data = [describe_model(config, model, started) for model in config.models]
    return encode_json(
        {
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"],
            "last_id": data[-1]["id"],
        }
    )


def _anthropic_error(status: int, error_type: str, message: str) -> ApiError:
    body = {"type": "error", "error": {"type": error_type, "message": message}}
    return ApiError(status, message, body=encode_json(body))


# Shared


def check_bearer(request: Request, config: MockConfig, *, ollama: bool = False) -> None:
    if config.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), config.api_key.encode()
    ):
        return
    if ollama:
        raise _ollama_error(401, "unauthorized")
    raise ApiError(401, "Invalid API Key", code="invalid_api_key")


def _require_get(request: Request) -> None:
    if request.method not in ("GET", "HEAD"):
        raise ApiError(
            405,
            f"Method {request.method} is not allowed for {request.path}; use GET.",
            headers=(("Allow", "GET"),),
        )


def _iso(epoch: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
