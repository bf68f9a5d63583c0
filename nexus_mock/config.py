"""The mock backend's knobs: one validated configuration, replaced as a whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nexus_mock.jobs import MAX_EMBEDDING_DIM

MAX_CHUNKS = 10_000
MAX_RECORDED_REQUESTS = 10_000
MOCK_KINDS = ("openai", "ollama", "vllm", "llamacpp", "anthropic")
OOM_STYLES = ("estimate", "runner")


class ConfigError(ValueError):
    """A knob was given a value it cannot take; ``knob`` names it."""

    def __init__(self, knob: str, message: str) -> None:
        super().__init__(message)
        self.knob = knob


@dataclass(frozen=True)
class MockConfig:
    """Everything that shapes the mock's answers; swapped whole at runtime.

    Times are in milliseconds. ``api_key`` None means no authentication;
    ``drop_after_chunks`` None means streams are never cut. ``kind`` picks the
    server imitated (see ``nexus_mock.kinds``); ``context_length``,
    ``loaded_models`` (None: all), ``vision_models``, ``tool_models`` and
    ``loading`` shape what its probe endpoints report. ``tool_arguments`` (a
    JSON object, None: made from the tool's schema) are the arguments of the
    tool calls the mock makes (see ``nexus_mock.tools``).
    ``slots`` > 0 serves at most that many inference requests at once, the
    others waiting in arrival order inside the mock, like a model server's own
    queue (0: no limit). ``model_sizes`` (GB per model), ``memory_gb``,
    ``load_seconds`` and ``keep_alive_seconds`` make an Ollama mock load and
    evict models like a node of a fleet (``nexus_mock.memory``).
    ``fail_on_text`` makes every inference request whose body holds that text
    (its UTF-8 bytes) fail with ``fail_status``: one input that crashes a model
    server while others are served. ``enforce_context`` refuses chats over
    ``context_length`` with the kind's overflow error (``nexus_mock.overflow``).
    """

    models: tuple[str, ...] = ()
    name: str = "mock"
    kind: str = "openai"
    latency_ms: float = 0.0
    prefill_ms_per_1k_tokens: float = 0.0
    chunks: int = 4
    chunk_delay_ms: float = 0.0
    embedding_dim: int = 8
    api_key: str | None = None
    fail_status: int = 500
    error_rate: float = 0.0
    fail_on_text: str | None = None
    drop_after_chunks: int | None = None
    seed: int = 0
    record_requests: int = 20
    context_length: int = 8192
    loaded_models: tuple[str, ...] | None = None
    vision_models: tuple[str, ...] = ()
    tool_models: tuple[str, ...] = ()
    loading: bool = False
    tool_arguments: dict[str, Any] | None = None
    slots: int = 0
    model_sizes: tuple[tuple[str, float], ...] = ()
    memory_gb: float | None = None
    load_seconds: float = 0.0
    keep_alive_seconds: float = 300.0
    enforce_context: bool = False
    # The version the kind's version endpoint reports (None: the kind's default).
    server_version: str | None = None
    # Learned capacity (Ollama): models other clients keep loaded (GB each;
    # listed by /api/ps, taking memory), and loads that do not fit failing with
    # one of Ollama's out-of-memory errors instead of loading anyway:
    # "estimate" (its refusal before loading, naming the sizes) or "runner"
    # (the runner dying in the load: "CUDA error: out of memory"). None: off.
    resident_models: tuple[tuple[str, float], ...] = ()
    oom_loads: str | None = None
    # vLLM's /metrics KV cache usage, 0..1 (None: no /metrics, a 404).
    kv_cache_usage: float | None = None
    # Prompt caching: prompt tokens each chat answer reports as read from the
    # server's prompt cache, and (Anthropic) as written to it. OpenAI and vLLM
    # report reads as usage.prompt_tokens_details.cached_tokens, llama.cpp as
    # timings.cache_n, Anthropic as cache_read_input_tokens and
    # cache_creation_input_tokens (nexus_mock.replies, nexus_mock.messages).
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    # A prompt cache (nexus_mock.prefix_cache): blocks of this many characters
    # (0: none), how many it holds, and the time each block not held takes.
    prefix_block_chars: int = 0
    prefix_cache_blocks: int = 1024
    prefix_block_ms: float = 0.0
    # A tail of slow first bytes: that fraction of inference requests (drawn
    # from a ``seed``-ed RNG) waits ``slow_ms`` more before its response head.
    slow_rate: float = 0.0
    slow_ms: float = 0.0

    @property
    def has_memory(self) -> bool:
        """Whether models load and unload (an Ollama node of a fleet)."""
        return self.kind == "ollama" and bool(
            self.model_sizes
            or self.memory_gb is not None
            or self.load_seconds > 0
            or self.resident_models
            or self.oom_loads is not None
        )

    def size_of(self, model: str) -> float | None:
        """The model's size in GB, when one was given."""
        return dict(self.model_sizes).get(model)

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, Any]) -> MockConfig:
        """Build a configuration from knob values; ``models`` is required."""
        if not knobs.get("models"):
            raise ConfigError("models", "At least one model is required (--models).")
        return cls().updated(knobs)

    def updated(self, changes: Mapping[str, Any]) -> MockConfig:
        """Return a copy with ``changes`` applied; raise ConfigError on a bad value.

        Knob names may use dashes or underscores (``latency-ms`` or ``latency_ms``).
        """
        values: dict[str, Any] = {}
        for raw_key, raw_value in changes.items():
            key = str(raw_key).replace("-", "_")
            validate = _VALIDATORS.get(key)
            if validate is None:
                known = ", ".join(sorted(_VALIDATORS))
                raise ConfigError(key, f"Unknown knob {key!r}. Known knobs: {known}.")
            values[key] = validate(key, raw_value)
        return dataclasses.replace(self, **values)

    def as_dict(self) -> dict[str, Any]:
        """Return the knobs as JSON-ready values."""
        values = {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in dataclasses.asdict(self).items()
        }
        values["model_sizes"] = dict(self.model_sizes)
        values["resident_models"] = dict(self.resident_models)
        return values


def _check_number(key: str, value: Any) -> float:
    # bool is an int subclass, and `true` for a delay is a mistake worth reporting.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, f"{key} must be a number, not {value!r}.")
    return value


def _int_knob(low: int, high: int) -> Callable[[str, Any], int]:
    def validate(key: str, value: Any) -> int:
        number = _check_number(key, value)
        if not float(number).is_integer() or not low <= number <= high:
            raise ConfigError(
                key,
                f"{key} must be a whole number from {low} to {high}, not {value!r}.",
            )
        return int(number)

    return validate


def _float_knob(low: float, high: float) -> Callable[[str, Any], float]:
    def validate(key: str, value: Any) -> float:
        number = _check_number(key, value)
        if not low <= number <= high:
            raise ConfigError(key, f"{key} must be from {low:g} to {high:g}.")
        return float(number)

    return validate


def _optional(
    validate: Callable[[str, Any], Any],
) -> Callable[[str, Any], Any]:
    def validate_optional(key: str, value: Any) -> Any:
        return None if value is None else validate(key, value)

    return validate_optional


def _validate_header_text(key: str, value: Any) -> str:
    # The name goes into a response header and the key is compared with one, so
    # both must be printable Latin-1 without line breaks.
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, f"{key} must be a non-empty string.")
    if not value.isprintable() or not value.isascii():
        raise ConfigError(key, f"{key} must be printable ASCII text.")
    return value.strip()


def _validate_text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 1000:
        raise ConfigError(key, f"{key} must be a string of 1 to 1000 characters.")
    return value


def _validate_kind(key: str, value: Any) -> str:
    if value not in MOCK_KINDS:
        raise ConfigError(
            key, f"{key} must be one of {', '.join(MOCK_KINDS)}, not {value!r}."
        )
    return str(value)


def _validate_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"{key} must be true or false, not {value!r}.")
    return value


def _validate_oom_style(key: str, value: Any) -> str:
    if value not in OOM_STYLES:
        raise ConfigError(
            key, f"{key} must be one of {', '.join(OOM_STYLES)} or null, not {value!r}."
        )
    return str(value)


def _validate_json_object(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(key, f"{key} must be a JSON object, not {value!r}.")
    return value


def _validate_model_subset(key: str, value: Any) -> tuple[str, ...]:
    """A list of model names that may be empty (unlike ``models``)."""
    if value == "" or value == []:
        return ()
    return _validate_models(key, value)


def _validate_model_sizes(key: str, value: Any) -> tuple[tuple[str, float], ...]:
    """{"name": GB} or ["name:GB", ...] -> sorted (name, GB) pairs."""
    items: list[tuple[Any, Any]]
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list | tuple):
        items = []
        for item in value:
            if isinstance(item, list | tuple) and len(item) == 2:
                items.append((item[0], item[1]))
            elif isinstance(item, str) and ":" in item:
                name, _, size = item.rpartition(":")
                try:
                    items.append((name, float(size)))
                except ValueError:
                    items.append((name, size))
            else:
                items.append((item, None))
    else:
        raise ConfigError(key, f"{key} must map model names to sizes in GB.")
    sizes: dict[str, float] = {}
    for name, size in items:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(key, f"{key}: model names must be non-empty strings.")
        if (
            isinstance(size, bool)
            or not isinstance(size, int | float)
            or not 0 < size <= 10_000
        ):
            raise ConfigError(
                key, f"{key}: the size of {name!r} must be from 0 to 10000 GB."
            )
        sizes[name.strip()] = float(size)
    return tuple(sorted(sizes.items()))


def _validate_models(key: str, value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(
        isinstance(item, str) for item in items
    ):
        raise ConfigError(
            key, f"{key} must be a comma-separated string or a list of strings."
        )
    models = tuple(dict.fromkeys(item.strip() for item in items if item.strip()))
    if not models:
        raise ConfigError(key, f"{key} must name at least one model.")
    return models


_VALIDATORS: dict[str, Callable[[str, Any], Any]] = {
    "models": _validate_models,
    "name": _validate_header_text,
    "latency_ms": _float_knob(0, 3_600_000),
    "prefill_ms_per_1k_tokens": _float_knob(0, 3_600_000),
    "chunks": _int_knob(1, MAX_CHUNKS),
    "chunk_delay_ms": _float_knob(0, 3_600_000),
    "embedding_dim": _int_knob(1, MAX_EMBEDDING_DIM),
    "api_key": _optional(_validate_header_text),
    "fail_status": _int_knob(400, 599),
    "error_rate": _float_knob(0, 1),
    "fail_on_text": _optional(_validate_text),
    "drop_after_chunks": _optional(_int_knob(0, MAX_CHUNKS)),
    "seed": _int_knob(-(2**63), 2**63 - 1),
    "record_requests": _int_knob(0, MAX_RECORDED_REQUESTS),
    "kind": _validate_kind,
    "context_length": _int_knob(1, 2**31 - 1),
    "loaded_models": _optional(_validate_model_subset),
    "vision_models": _validate_model_subset,
    "tool_models": _validate_model_subset,
    "loading": _validate_bool,
    "tool_arguments": _optional(_validate_json_object),
    "slots": _int_knob(0, 100_000),
    "model_sizes": _validate_model_sizes,
    "memory_gb": _optional(_float_knob(0.001, 100_000)),
    "load_seconds": _float_knob(0, 3600),
    "keep_alive_seconds": _float_knob(-1, 86_400),
    "enforce_context": _validate_bool,
    "server_version": _optional(_validate_header_text),
    "resident_models": _validate_model_sizes,
    "oom_loads": _optional(_validate_oom_style),
    "kv_cache_usage": _optional(_float_knob(0, 1)),
    "cached_tokens": _int_knob(0, 10**9),
    "cache_write_tokens": _int_knob(0, 10**9),
    "prefix_block_chars": _int_knob(0, 1_000_000),
    "prefix_cache_blocks": _int_knob(1, 10_000_000),
    "prefix_block_ms": _float_knob(0, 3_600_000),
    "slow_rate": _float_knob(0, 1),
    "slow_ms": _float_knob(0, 3_600_000),
}
