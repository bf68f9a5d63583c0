"""OTLP's protobuf encoding of span records (an ``ExportTraceServiceRequest``).

The OpenTelemetry SDK encodes a span by building protobuf messages from its
``ReadableSpan`` and hashing the resource per span: about 90 µs a span here,
more than everything else tracing costs a request. The records of
gateway/tracing/spans.py have one fixed shape, so they are written straight to the
wire format (opentelemetry/proto/trace/v1/trace.proto): a few µs a span. The
tests decode the result with the official protobuf classes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

# Field numbers (trace.proto, common.proto, resource.proto, trace_service.proto).
_REQUEST_RESOURCE_SPANS = 1
_RESOURCE_SPANS_RESOURCE, _RESOURCE_SPANS_SCOPE_SPANS = 1, 2
_RESOURCE_ATTRIBUTES = 1
_SCOPE_SPANS_SCOPE, _SCOPE_SPANS_SPANS = 1, 2
_SCOPE_NAME, _SCOPE_VERSION = 1, 2
_SPAN_TRACE_ID, _SPAN_SPAN_ID, _SPAN_TRACE_STATE, _SPAN_PARENT_SPAN_ID = 1, 2, 3, 4
_SPAN_NAME, _SPAN_KIND, _SPAN_START, _SPAN_END = 5, 6, 7, 8
_SPAN_ATTRIBUTES, _SPAN_STATUS, _SPAN_FLAGS = 9, 15, 16
_STATUS_MESSAGE, _STATUS_CODE = 2, 3
_KEY_VALUE_KEY, _KEY_VALUE_VALUE = 1, 2
_ANY_STRING, _ANY_BOOL, _ANY_INT, _ANY_DOUBLE = 1, 2, 3, 4
# Wire types.
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
# SpanFlags: the W3C flags (sampled) and whether the parent is remote.
_FLAGS_SAMPLED = 0x01
_FLAGS_CONTEXT_HAS_IS_REMOTE = 0x100
_FLAGS_CONTEXT_IS_REMOTE = 0x200
_INT64_LIMIT = 1 << 63


class Record(Protocol):
    """What is encoded of a span (gateway.tracing.SpanRecord)."""

    name: str
    kind: int
    trace_id: int
    span_id: int
    parent_id: int
    remote_parent: bool
    attributes: dict[str, Any]
    start: int
    end: int
    status: int
    message: str
    trace_state: str


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint((field << 3) | wire)


def _length(field: int, payload: bytes) -> bytes:
    return _tag(field, _LENGTH) + _varint(len(payload)) + payload


def _any_value(value: Any) -> bytes:
    if isinstance(value, str):
        return _length(_ANY_STRING, value.encode("utf-8", "replace"))
    if isinstance(value, bool):
        return _tag(_ANY_BOOL, _VARINT) + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        if not -_INT64_LIMIT <= value < _INT64_LIMIT:
            return _length(_ANY_STRING, str(value).encode())
        return _tag(_ANY_INT, _VARINT) + _varint(value % (1 << 64))
    if isinstance(value, float):
        return _tag(_ANY_DOUBLE, _FIXED64) + struct.pack("<d", value)
    return _length(_ANY_STRING, str(value).encode("utf-8", "replace"))


def _key_value(field: int, key: str, value: Any) -> bytes:
    return _length(
        field,
        _length(_KEY_VALUE_KEY, key.encode("utf-8", "replace"))
        + _length(_KEY_VALUE_VALUE, _any_value(value)),
    )


# Most attributes repeat from request to request (operation, models, backends,
# key names, routes, statuses, token counts): their encoding is kept, up to a
# bound. A request's id never repeats.
_ENCODED: dict[tuple[int, str, type, Any], bytes] = {}
ENCODED_MAX = 4096
UNIQUE_KEYS = frozenset({"nexus.request_id"})


def encode_attributes(field: int, attributes: Mapping[str, Any]) -> bytes:
    """Repeated ``KeyValue`` under `field`."""
    parts = []
    encoded = _ENCODED
    for key, value in attributes.items():
        kind = type(value)
        if (kind is str or kind is bool or kind is int) and key not in UNIQUE_KEYS:
            cache_key = (field, key, kind, value)
            part = encoded.get(cache_key)
            if part is None:
                if len(encoded) >= ENCODED_MAX:
                    encoded.clear()
                part = encoded[cache_key] = _key_value(field, key, value)
            parts.append(part)
        else:
            parts.append(_key_value(field, key, value))
    return b"".join(parts)


def _cached(field: int, text: str) -> bytes:
    """A length-delimited string field, its encoding kept (names repeat)."""
    cache_key = (field, "", str, text)
    part = _ENCODED.get(cache_key)
    if part is None:
        if len(_ENCODED) >= ENCODED_MAX:
            _ENCODED.clear()
        part = _ENCODED[cache_key] = _length(field, text.encode("utf-8", "replace"))
    return part


# The fixed heads of a span's fields (tag and, for ids, length).
_TRACE_ID_HEAD = _tag(_SPAN_TRACE_ID, _LENGTH) + _varint(16)
_SPAN_ID_HEAD = _tag(_SPAN_SPAN_ID, _LENGTH) + _varint(8)
_PARENT_ID_HEAD = _tag(_SPAN_PARENT_SPAN_ID, _LENGTH) + _varint(8)
_KIND_HEAD = _tag(_SPAN_KIND, _VARINT)
_START_HEAD, _END_HEAD = _tag(_SPAN_START, _FIXED64), _tag(_SPAN_END, _FIXED64)
_FLAGS_HEAD = _tag(_SPAN_FLAGS, _FIXED32)
_LOCAL_PARENT = _FLAGS_HEAD + struct.pack(
    "<I", _FLAGS_SAMPLED | _FLAGS_CONTEXT_HAS_IS_REMOTE
)
_REMOTE_PARENT = _FLAGS_HEAD + struct.pack(
    "<I", _FLAGS_SAMPLED | _FLAGS_CONTEXT_HAS_IS_REMOTE | _FLAGS_CONTEXT_IS_REMOTE
)
_TIMES = struct.Struct("<Q")


def _span(record: Record) -> bytes:
    parent = record.parent_id
    parts = [
        _TRACE_ID_HEAD,
        record.trace_id.to_bytes(16, "big"),
        _SPAN_ID_HEAD,
        record.span_id.to_bytes(8, "big"),
    ]
    if record.trace_state:
        parts.append(_cached(_SPAN_TRACE_STATE, record.trace_state))
    if parent:
        parts += (_PARENT_ID_HEAD, parent.to_bytes(8, "big"))
    parts += (
        _cached(_SPAN_NAME, record.name),
        _KIND_HEAD,
        _varint(record.kind),
        _START_HEAD,
        _TIMES.pack(record.start),
        _END_HEAD,
        _TIMES.pack(record.end),
        encode_attributes(_SPAN_ATTRIBUTES, record.attributes),
    )
    if record.status:
        status = _tag(_STATUS_CODE, _VARINT) + _varint(record.status)
        if record.message:
            status = _length(_STATUS_MESSAGE, record.message.encode()) + status
        parts.append(_length(_SPAN_STATUS, status))
    parts.append(_REMOTE_PARENT if parent and record.remote_parent else _LOCAL_PARENT)
    return b"".join(parts)


def encode_request(
    records: Iterable[Record], resource: Mapping[str, Any], scope: tuple[str, str]
) -> bytes:
    """One ``ExportTraceServiceRequest`` with every record (one resource, one scope)."""
    spans = b"".join(_length(_SCOPE_SPANS_SPANS, _span(record)) for record in records)
    name, version = scope
    scope_message = _length(_SCOPE_NAME, name.encode()) + (
        _length(_SCOPE_VERSION, version.encode()) if version else b""
    )
    scope_spans = _length(_SCOPE_SPANS_SCOPE, scope_message) + spans
    resource_spans = _length(
        _RESOURCE_SPANS_RESOURCE, encode_attributes(_RESOURCE_ATTRIBUTES, resource)
    ) + _length(_RESOURCE_SPANS_SCOPE_SPANS, scope_spans)
    return _length(_REQUEST_RESOURCE_SPANS, resource_spans)
