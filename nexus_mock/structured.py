"""Structured output: the JSON the mock answers in JSON mode or to a schema.

A chat (or completion) that asks for JSON gets JSON instead of the echo:

- ``response_format: {"type": "json_object"}`` (OpenAI), ``format: "json"``
  (Ollama): ``{"answer": "[<name>/<model>] echo: <last user text>"}``;
- ``response_format: {"type": "json_schema", "json_schema": {"schema": S}}``
  (OpenAI; the Responses API's ``text.format`` arrives translated by the
  gateway), ``format: S`` (Ollama): a value that fits S, made by
  ``generate_json``.

The generator is small and deterministic. An object gets every property
(required or not); a string is the last user text (or ``enum``'s first value,
``const``, a fixed sample of a ``format`` such as ``date-time`` or ``email``),
padded or cut to ``minLength``/``maxLength``; an integer or number is the
number of words of the user text, moved into ``minimum``/``maximum`` (and the
exclusive bounds, ``multipleOf``); a boolean is ``true``; an array has
``minItems`` items (at least one, at most ``maxItems``); ``$ref`` to
``#/$defs/...`` or ``#/definitions/...`` is followed, ``anyOf``/``oneOf`` take
their first branch, ``allOf`` is merged, a list of types takes the first that is
not ``null``. Past ``SHALLOW_DEPTH`` levels (a recursive schema) only what is
required is made: objects get their required properties, arrays ``minItems``
items, and ``anyOf``/``oneOf`` take a ``null`` (else a scalar) branch if they
have one. ``pattern`` is not honoured.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

SHALLOW_DEPTH = 6
MAX_DEPTH = 32
# Values made for one reply at most: a schema cannot make the mock build a
# huge reply (minItems of a million, deep recursion).
MAX_NODES = 10_000
MAX_ITEMS = 256
MAX_STRING = 10_000
MAX_RESOLVE = 8  # $ref and allOf followed in a row

_FORMATS = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00Z",
    "duration": "PT1M",
    "email": "mock@example.com",
    "idn-email": "mock@example.com",
    "hostname": "example.com",
    "idn-hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "uri": "https://example.com/",
    "iri": "https://example.com/",
    "uri-reference": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
}


class FormatError(ValueError):
    """The requested format is malformed; ``param`` names where."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """JSON wanted: any object (``schema`` None) or one that fits ``schema``."""

    schema: dict[str, Any] | bool | None = None


def read_response_format(value: Any) -> OutputFormat | None:
    """Read OpenAI's ``response_format``; None for plain text."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FormatError("response_format", "'response_format' must be an object.")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise FormatError(
                "response_format.json_schema",
                "'response_format.json_schema' must be an object.",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict | bool):
            raise FormatError(
                "response_format.json_schema.schema",
                "'response_format.json_schema.schema' must be a JSON schema object.",
            )
        return OutputFormat(schema)
    raise FormatError(
        "response_format.type",
        "'response_format.type' must be 'text', 'json_object' or 'json_schema'.",
    )


def read_ollama_format(value: Any) -> OutputFormat | None:
    """Read Ollama's ``format`` ("json" or a schema); None for plain text."""
    if value is None or value == "":
        return None
    if value == "json":
        return OutputFormat()
    if isinstance(value, dict):
        return OutputFormat(value)
    raise FormatError("format", 'invalid format: expected "json" or a JSON schema')


def render_structured(fmt: OutputFormat, echo: str, user_text: str) -> str:
    """The reply text for ``fmt``: compact JSON."""
    if fmt.schema is None:
        value: Any = {"answer": echo}
    else:
        value = generate_json(fmt.schema, user_text)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def generate_json(schema: dict[str, Any] | bool, text: str) -> Any:
    """A value that fits ``schema``, made from the user's ``text``."""
    root = schema if isinstance(schema, dict) else {}
    return _Generator(root, text).make(schema, 0)


class _Generator:
    def __init__(self, root: dict[str, Any], text: str) -> None:
        self._root = root
        self._text = text or "mock"
        self._nodes = 0

    def make(self, schema: Any, depth: int) -> Any:
        self._nodes += 1
        if not isinstance(schema, dict) or depth > MAX_DEPTH or self._nodes > MAX_NODES:
            return None
        schema = self._resolve(schema, 0)
        if "const" in schema:
            return schema["const"]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return enum[0]
        shallow = depth > SHALLOW_DEPTH
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                branch = _cheapest(branches) if shallow else branches[0]
                return self.make(branch, depth + 1)
        kind = _type_of(schema)
        if kind == "null":
            return None
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "string":
            return _string(schema, self._text)
        if kind in ("integer", "number"):
            return _number(schema, len(self._text.split()), kind == "integer")
        if kind == "boolean":
            return True
        return self._text

    def _resolve(self, schema: dict[str, Any], level: int) -> dict[str, Any]:
        """Follow ``$ref`` and merge ``allOf`` (a few levels, within the budget)."""
        for _ in range(MAX_RESOLVE):
            self._nodes += 1
            if level > MAX_RESOLVE or self._nodes > MAX_NODES:
                break
            ref = schema.get("$ref")
            if isinstance(ref, str):
                rest = {k: v for k, v in schema.items() if k != "$ref"}
                schema = {**self._lookup(ref), **rest}
                continue
            parts = schema.get("allOf")
            if not isinstance(parts, list) or not parts:
                break
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in parts:
                if isinstance(part, dict):
                    merged = _merge(merged, self._resolve(part, level + 1))
            schema = merged
        return schema

    def _lookup(self, ref: str) -> dict[str, Any]:
        if ref == "#":
            return self._root
        if not ref.startswith("#/"):
            return {}
        node: Any = self._root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node if isinstance(node, dict) else {}

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        needed = schema.get("required")
        needed = set(needed) if isinstance(needed, list) else set()
        value: dict[str, Any] = {}
        for name, spec in properties.items():
            if depth > SHALLOW_DEPTH and name not in needed:
                continue
            value[name] = self.make(spec, depth + 1)
        extra = schema.get("additionalProperties")
        wanted = _bounded(schema.get("minProperties"), 0, MAX_ITEMS)
        for index in range(wanted - len(value)):
            spec = extra if isinstance(extra, dict) else {}
            value[f"key{index + 1}"] = self.make(spec, depth + 1)
        return value

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        least = _bounded(schema.get("minItems"), 0, MAX_ITEMS)
        most = _bounded(schema.get("maxItems"), 0, MAX_ITEMS, default=MAX_ITEMS)
        count = least if depth > SHALLOW_DEPTH else max(least, 1, len(prefix))
        count = min(count, most)
        items = schema.get("items")
        unique = schema.get("uniqueItems") is True
        values = []
        for index in range(count):
            spec = prefix[index] if index < len(prefix) else items
            item = self.make(spec if spec is not None else {}, depth + 1)
            if unique and index:
                item = _vary(item, index)
            values.append(item)
        return values


def _type_of(schema: dict[str, Any]) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if kinds else "null"
    if isinstance(kind, str):
        return kind
    if "properties" in schema or "additionalProperties" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return None


def _cheapest(branches: list[Any]) -> Any:
    """The branch that ends a recursion soonest: null, else a scalar one."""
    for wanted in ("null", "scalar"):
        for branch in branches:
            if not isinstance(branch, dict):
                continue
            kind = branch.get("type")
            if kind == wanted or (
                wanted == "scalar"
                and kind in ("string", "integer", "number", "boolean")
            ):
                return branch
    return branches[0]


def _merge(base: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    merged = {**part, **base}
    for key in ("properties",):
        if isinstance(base.get(key), dict) and isinstance(part.get(key), dict):
            merged[key] = {**part[key], **base[key]}
    if isinstance(base.get("required"), list) and isinstance(
        part.get("required"), list
    ):
        merged["required"] = [*part["required"], *base["required"]]
    return merged


def _string(schema: dict[str, Any], text: str) -> str:
    fmt = schema.get("format")
    value = _FORMATS.get(fmt, text) if isinstance(fmt, str) else text
    least = _bounded(schema.get("minLength"), 0, MAX_STRING)
    most = _bounded(schema.get("maxLength"), 0, MAX_STRING, default=MAX_STRING)
    if len(value) < least:
        value += "x" * (least - len(value))
    return value[:most]


def _number(schema: dict[str, Any], words: int, integer: bool) -> int | float:
    value: float = words
    low = _finite(schema.get("minimum"))
    high = _finite(schema.get("maximum"))
    above = _finite(schema.get("exclusiveMinimum"))
    below = _finite(schema.get("exclusiveMaximum"))
    step = 1.0 if integer else 0.5
    if above is not None:
        low = max(low, above + step) if low is not None else above + step
    if below is not None:
        high = min(high, below - step) if high is not None else below - step
    if not integer and above is not None and below is not None and above >= below - 1:
        # A narrow open interval: its middle.
        low = high = (above + below) / 2
    if low is not None:
        value = max(value, math.ceil(low) if integer else low)
    if high is not None:
        value = min(value, math.floor(high) if integer else high)
    multiple = _finite(schema.get("multipleOf"))
    if multiple is not None and multiple > 0:
        value = math.ceil(value / multiple) * multiple
        if high is not None and value > high:
            value -= multiple
    if integer:
        return int(value)
    return float(value)


def _vary(item: Any, index: int) -> Any:
    """Make the ``index``-th item of a ``uniqueItems`` array differ."""
    if isinstance(item, str):
        return f"{item} {index}"
    if isinstance(item, bool) or item is None:
        return item
    if isinstance(item, int | float):
        return item + index
    return item


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _bounded(value: Any, low: int, high: int, *, default: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return default
    return max(low, min(high, value))
