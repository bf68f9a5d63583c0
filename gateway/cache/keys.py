"""The cache key of a request: its canonical form, made canonical once more.

Two requests get the same key when the gateway would send the same request
upstream for them: the canonical (OpenAI-shaped) body every surface is
translated to, parsed JSON re-serialised with sorted keys and numbers
normalised (``1.0`` is ``1``), minus the fields that do not change the answer
(``stream``, ``stream_options``, ``user``, ``metadata``, ``n`` when 1), with
the served model (after alias resolution) in place of the name asked for,
plus the endpoint it is canonical for (chat or embeddings), what the
client's own protocol carries that its canonical form leaves out, and the
scope (a key's prefix, or shared). So an OpenAI SDK request, the same JSON
from curl with keys in another order, and the same chat through the Ollama
or Anthropic surface share one entry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

# Fields of a canonical request that change nothing in the answer.
IGNORED_FIELDS = frozenset({"stream", "stream_options", "user", "metadata"})
# A client's own fields that its canonical form leaves out but that change the
# answer of a backend speaking its protocol natively, per surface protocol.
NATIVE_FIELDS: Mapping[str, tuple[str, ...]] = {
    "anthropic": ("thinking", "top_k"),
    "ollama": ("think",),
}
# Ollama's options that its canonical form carries (the rest, such as num_ctx
# or top_k, go into the key as they are).
_OLLAMA_CANONICAL_OPTIONS = frozenset(
    {
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "num_predict",
        "stop",
    }
)
# Integers past this are not floats' exact integers: left as written.
_EXACT_FLOAT = 2**53


def normalised(value: Any) -> Any:
    """`value` with every integral float as an int (``0.0`` -> ``0``)."""
    if isinstance(value, float):
        if value.is_integer() and -_EXACT_FLOAT < value < _EXACT_FLOAT:
            return int(value)
        return value
    if isinstance(value, dict):
        return {key: normalised(item) for key, item in value.items()}
    if isinstance(value, list):
        return [normalised(item) for item in value]
    return value


def canonical_request(
    canonical: Mapping[str, Any],
    model: str,
    endpoint: str,
    native: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The request as the key sees it (before serialising)."""
    body = {
        name: value
        for name, value in canonical.items()
        if name not in IGNORED_FIELDS and not (name == "n" and value == 1)
    }
    body["model"] = model
    request: dict[str, Any] = {"endpoint": endpoint, "body": body}
    if native:
        request["native"] = native
    return request


def request_digest(request: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the request serialised canonically."""
    data = orjson.dumps(
        normalised(request), option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
    )
    return hashlib.sha256(data).hexdigest()


def native_fields(protocol: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The client's fields its canonical form leaves out (see NATIVE_FIELDS)."""
    names = NATIVE_FIELDS.get(protocol, ())
    found = {name: payload[name] for name in names if payload.get(name) is not None}
    options = payload.get("options") if protocol == "ollama" else None
    if isinstance(options, dict):
        rest = {
            name: value
            for name, value in options.items()
            if name not in _OLLAMA_CANONICAL_OPTIONS and value is not None
        }
        if rest:
            found["options"] = rest
    return found


def is_deterministic(canonical: Mapping[str, Any], endpoint: str) -> bool:
    """Whether the request asks for a repeatable answer: temperature 0, or a
    seed; an embedding always is."""
    if endpoint == "embeddings":
        return True
    temperature = canonical.get("temperature")
    if (
        isinstance(temperature, int | float)
        and not isinstance(temperature, bool)
        and temperature == 0
    ):
        return True
    seed = canonical.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool)
