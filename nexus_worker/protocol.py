"""The worker relay's wire protocol: message types, encode() and decode().

A worker (``nexus-worker``, a GPU box behind NAT) dials in to the gateway over one
WebSocket and the two sides exchange JSON text frames, each an object with a
``"type"``. This module is the whole vocabulary, shared by the gateway's consumer
and the worker daemon, so it imports nothing but the standard library (an
import-linter contract keeps it so: no Django, Channels, asyncio or aiohttp).

``decode()`` checks every field of every known type (kinds and sizes) and raises
``ProtocolError`` with a message naming the type and field; a frame whose
``"type"`` is not known decodes to ``Unknown``, which the caller logs and ignores
(a newer peer may speak more). Extra fields are ignored for the same reason.

Bodies and chunks are opaque text. Chunks are sent only for a successful (2xx)
streamed response; ``response_complete`` then follows with ``body`` null. A
response that is not streamed, or one that failed, comes whole in
``response_complete.body`` unless it is too big for one frame, in which case it
comes as chunks followed by ``response_complete`` with ``body`` null as well: a
null body always means "the body is the chunks sent before".

``register`` and ``pong`` may carry ``state``: what the worker's local model
server reports of itself (the models it has loaded, with their memory, context
window and keep_alive; the memory it may fill; its parallel slots), read by the
worker with the probes the gateway's health round uses for a direct backend.
An older worker sends none and an older gateway ignores it (extra fields are).

An ``error`` from the worker with a request_id fails that request (codes below:
``draining``, ``at_capacity``, ``endpoint_not_allowed``, ``response_too_large``
after some chunks, ...). Without a request_id and with code ``draining`` it says
the whole worker is draining (SIGTERM or graceful_shutdown): send it no more.
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, dataclass, field, fields
from enum import IntEnum
from typing import Any, ClassVar
from urllib.parse import urlencode, urlsplit, urlunsplit

PROTOCOL_VERSION = 1
# Where workers connect (under the gateway's base URL) and how they authenticate.
WEBSOCKET_PATH = "/ws/workers/"
SECRET_HEADER = "x-worker-secret"
NAME_QUERY_PARAM = "name"
# The gateway pings every interval; three missed intervals make a worker Gone.
DEFAULT_HEARTBEAT_SECONDS = 5.0
MISSED_HEARTBEATS_BEFORE_GONE = 3
# One frame (either way); bigger ones close the socket with TOO_BIG.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# What the worker puts in one response_chunk (or an inline body): with JSON's
# worst-case escaping (6 bytes for a control character) the frame still fits
# in 1 MiB, Daphne's default limit on a message it receives, so a gateway
# under plain `daphne` (without nexus_run's 16 MiB) takes every answer too.
MAX_CHUNK_CHARS = 160 * 1024
# Daphne's default --websocket-max-message-size.
DAPHNE_DEFAULT_MESSAGE_BYTES = 1024 * 1024
# The longest model name a worker may announce: the gateway's column for it
# (backends.models.BackendModel.name) holds no more, and one longer name
# would cost the whole models_update.
MAX_MODEL_NAME = 200
# Messages nest two deep (a list of models, an object of headers). A frame
# nested deeper than this is refused before ``json.loads`` sees it: the parser
# recurses once per level and gives up only at the interpreter's limit, with a
# RecursionError that no caller expects.
MAX_NESTING = 32
# Values (list items and object members) one frame may hold: a register's 2,000
# models and a reply's 64 headers fit many times over. ``json.loads`` spends
# about a third of a microsecond on each, so a 16 MiB frame of tiny elements
# (``[0,0,0,...]``, 8 million of them) held the gateway's event loop for
# seconds; such a frame is refused after a count of its separators.
MAX_ELEMENTS = 8192

# The only endpoints a worker forwards to its local backend (POST).
RELAY_ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/messages",
        "/v1/responses",
        "/api/chat",
        "/api/generate",
        "/api/embed",
        "/api/embeddings",
    }
)

# Ollama's model management, and the method each takes: forwarded only by a
# worker whose owner allowed it (``--allow-model-management``), to an Ollama
# server; any other worker refuses it with ERROR_MANAGEMENT_NOT_ALLOWED.
MANAGEMENT_ENDPOINTS = {
    "/api/pull": "POST",
    "/api/push": "POST",
    "/api/copy": "POST",
    "/api/create": "POST",
    "/api/delete": "DELETE",
}

# Error codes a worker sends in ``error.code`` (request-scoped when it has a
# request_id: that request fails).
ERROR_DRAINING = "draining"
ERROR_AT_CAPACITY = "at_capacity"
ERROR_ENDPOINT_NOT_ALLOWED = "endpoint_not_allowed"
ERROR_DUPLICATE_REQUEST = "duplicate_request"
ERROR_BACKEND_UNAVAILABLE = "backend_unavailable"
ERROR_RESPONSE_TOO_LARGE = "response_too_large"
ERROR_BAD_MESSAGE = "bad_message"
ERROR_MANAGEMENT_NOT_ALLOWED = "management_not_allowed"


class CloseCode(IntEnum):
    """WebSocket close codes the gateway uses for a worker's socket."""

    NORMAL = 1000
    TOO_BIG = 1009
    AUTH_FAILED = 4001
    UNSUPPORTED_VERSION = 4002
    BAD_FRAME = 4003
    # Over its rates for too long (frames, bytes) or reconnecting too often.
    RATE_LIMITED = 4029
    # Too many failed authentications from this address: refused unchecked.
    AUTH_THROTTLED = 4030
    # A control-only Nexus process (NEXUS_ROLE=control): workers dial the gateway.
    NOT_SERVED_HERE = 4404


class ProtocolError(ValueError):
    """A frame that is not a valid message (bad JSON, missing or wrong field).

    ``request_id`` is the frame's own when it had a usable one, so the receiver
    can fail that request at once instead of letting it wait.
    """

    request_id: str | None = None


class UnsupportedVersion(ProtocolError):
    """register or register_ack with a protocol_version this side does not speak."""


class UnreadableFrame(ProtocolError):
    """A frame no peer of this protocol sends, refused before ``json.loads``
    sees it: the receiver closes the socket (CloseCode.BAD_FRAME)."""


class FrameTooDeep(UnreadableFrame):
    """A frame nested deeper than MAX_NESTING."""


class FrameTooWide(UnreadableFrame):
    """A frame of more than MAX_ELEMENTS values."""


# Bounds on everything that comes from the other side.
_MAX_NAME = 200
_MAX_MODELS = 2000
_MAX_ID = 256
_MAX_SHORT = 64
_MAX_MESSAGE = 8192
_MAX_HEADERS = 64
_MAX_HEADER_NAME = 256
_MAX_HEADER_VALUE = 8192
_MAX_LOAD = 1_000_000
_MAX_CONCURRENCY = 10_000
# A backend state's bounds: models loaded at once, bytes of memory (1 PB, as
# the health round's sizes), a context window, a keep_alive (a year: longer
# means "never" and is sent as none), parallel slots.
MAX_LOADED_MODELS = 64
MAX_MEMORY_BYTES = 10**15
_MAX_CONTEXT = 2**31 - 1
MAX_EXPIRES_IN = 366 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """One model the worker's backend has in memory (None: it did not say)."""

    name: str
    vram_bytes: int | None = None
    context_length: int | None = None
    # Seconds until the backend unloads it (Ollama's keep_alive), from when
    # the worker read it: relative, so that the two clocks need not agree.
    expires_in: float | None = None


@dataclass(frozen=True, slots=True)
class BackendState:
    """What the worker's local backend reports of itself (None: unknown).

    ``loaded`` None means the backend does not say what it has loaded (an
    empty tuple: nothing is loaded). ``memory_bytes`` is what its models may
    fill (the worker's ``--memory-gb``); ``slots`` and ``busy_slots`` its
    parallel slots and how many are busy (llama.cpp's /slots).
    """

    loaded: tuple[LoadedModel, ...] | None = None
    memory_bytes: int | None = None
    slots: int | None = None
    busy_slots: int | None = None


@dataclass(frozen=True, slots=True)
class Register:
    """Worker -> server, first frame: who it is and what it serves."""

    type: ClassVar[str] = "register"
    name: str
    models: list[str]
    max_concurrency: int
    load: int = 0
    protocol_version: int = PROTOCOL_VERSION
    backend_kind: str | None = None
    version: str | None = None
    state: BackendState | None = None


@dataclass(frozen=True, slots=True)
class ModelsUpdate:
    """Worker -> server: its local backend's models changed."""

    type: ClassVar[str] = "models_update"
    models: list[str]
    load: int = 0


@dataclass(frozen=True, slots=True)
class ResponseChunk:
    """Worker -> server: the next piece of a response body, in order."""

    type: ClassVar[str] = "response_chunk"
    request_id: str
    chunk: str


@dataclass(frozen=True, slots=True)
class ResponseComplete:
    """Worker -> server: the request is done (body null: it was the chunks)."""

    type: ClassVar[str] = "response_complete"
    request_id: str
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: str | None = None


@dataclass(frozen=True, slots=True)
class Pong:
    """Worker -> server: answer to ping, with the requests in flight and
    (newer workers) its backend's state."""

    type: ClassVar[str] = "pong"
    load: int
    timestamp: float | None = None
    state: BackendState | None = None


@dataclass(frozen=True, slots=True)
class Error:
    """Either way: something failed; with request_id, that request fails."""

    type: ClassVar[str] = "error"
    message: str
    request_id: str | None = None
    code: str | None = None


@dataclass(frozen=True, slots=True)
class RegisterAck:
    """Server -> worker: registered; the models it will route to this worker."""

    type: ClassVar[str] = "register_ack"
    worker_id: str
    models: list[str]
    protocol_version: int = PROTOCOL_VERSION
    heartbeat_interval: float = DEFAULT_HEARTBEAT_SECONDS


@dataclass(frozen=True, slots=True)
class Request:
    """Server -> worker: send this request to the local backend."""

    type: ClassVar[str] = "request"
    request_id: str
    model: str
    endpoint: str
    body: str
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    is_streaming: bool = False


@dataclass(frozen=True, slots=True)
class Cancel:
    """Server -> worker: the client went away; abort that request."""

    type: ClassVar[str] = "cancel"
    request_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Ping:
    """Server -> worker: heartbeat probe.

    ``interval``: the seconds until the next ping at most, when the gateway
    stretched it past register_ack's ``heartbeat_interval`` (it does so with
    many workers: gateway/relay/heartbeats.py); the worker's patience with a
    silent gateway follows it. Older gateways do not send it.
    """

    type: ClassVar[str] = "ping"
    timestamp: float
    interval: float | None = None


@dataclass(frozen=True, slots=True)
class GracefulShutdown:
    """Server -> worker: take no new requests, finish in-flight ones, exit."""

    type: ClassVar[str] = "graceful_shutdown"
    reason: str | None = None
    timeout_secs: float | None = None


@dataclass(frozen=True, slots=True)
class ModelsRefresh:
    """Server -> worker: list the local backend's models again."""

    type: ClassVar[str] = "models_refresh"


@dataclass(frozen=True, slots=True)
class Unknown:
    """A frame of a type this side does not know: log it and carry on."""

    type_name: str


Message = (
    Register
    | ModelsUpdate
    | ResponseChunk
    | ResponseComplete
    | Pong
    | Error
    | RegisterAck
    | Request
    | Cancel
    | Ping
    | GracefulShutdown
    | ModelsRefresh
)


def encode(message: Message) -> str:
    """Return ``message`` as one JSON text frame (optional fields left out when None)."""
    data: dict[str, Any] = {"type": message.type}
    data.update(_as_json(message, _NULLABLE_KEPT))
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _as_json(value: Any, kept: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A message's (or a nested record's) fields as JSON values, None left out
    except for the fields in `kept`."""
    data: dict[str, Any] = {}
    for item in fields(value):
        field_value = getattr(value, item.name)
        if isinstance(field_value, BackendState):
            field_value = _as_json(field_value)
        elif isinstance(field_value, tuple):
            field_value = [_as_json(entry) for entry in field_value]
        if field_value is not None or item.name in kept:
            data[item.name] = field_value
    return data


# Fields the spec shows as present-but-null rather than absent.
_NULLABLE_KEPT = frozenset({"body", "timestamp", "reason", "timeout_secs"})


def decode(text: str | bytes) -> Message | Unknown:
    """Parse and check one frame; raise ProtocolError if it is not a valid message."""
    if len(text) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(text)} bytes is over {MAX_FRAME_BYTES}")
    _check_shape(text if isinstance(text, str) else text.decode("latin-1"))
    try:
        data = json.loads(text)
    except RecursionError:
        raise FrameTooDeep(f"frame nested more than {MAX_NESTING} deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("frame is not a JSON object")
    type_name = data.get("type")
    if not isinstance(type_name, str):
        raise ProtocolError('frame has no "type" string')
    spec = _SPECS.get(type_name)
    if spec is None:
        return Unknown(type_name=type_name[:_MAX_SHORT])
    cls, checks = spec
    try:
        message: Message = cls(**_checked_fields(type_name, cls, checks, data))
    except ProtocolError as error:
        request_id = data.get("request_id")
        if isinstance(request_id, str) and 0 < len(request_id) <= _MAX_ID:
            error.request_id = request_id
        raise
    version = getattr(message, "protocol_version", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"{type_name}: protocol_version {version} is not {PROTOCOL_VERSION}"
        )
    return message


# A string once its escaped quotes and backslashes are gone (see _outside_strings).
_QUOTED = re.compile(r'"[^"]*"')
# Brackets of either kind become [ and ] (the depth is the same); all else goes.
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _check_shape(text: str) -> None:
    """Raise FrameTooDeep or FrameTooWide for JSON that nests more than
    MAX_NESTING deep or holds more than MAX_ELEMENTS values.

    Linear, in C rather than a Python loop over the characters. Most frames
    are settled by counting brackets and separators in the whole text; only
    when those counts are high (a body of JSON inside a string, or a hostile
    frame) are the strings cut out and the structure outside them counted.
    """
    separators = text.count(",") + text.count(":")
    if text.count("[") + text.count("{") <= MAX_NESTING:
        if separators <= MAX_ELEMENTS:
            return
        outside = _outside_strings(text)
    else:
        outside = _outside_strings(text)
        if _nests_deeper(outside):
            raise FrameTooDeep(f"frame nested more than {MAX_NESTING} deep")
    if outside is not text and outside is not None:
        separators = outside.count(",") + outside.count(":")
    if outside is None or separators > MAX_ELEMENTS:
        raise FrameTooWide(f"frame of more than {MAX_ELEMENTS} values")


def _outside_strings(text: str) -> str | None:
    """The JSON in `text` without its strings (None: more strings than a frame
    of MAX_ELEMENTS values holds, so too wide anyway).

    Escaped backslashes go first, then escaped quotes (left to right, as a
    parser pairs them), so that every quote left opens or closes a string.
    Faster than one regular expression that steps over each escape: a reply
    body of JSON inside a string has one at every quote of it.
    """
    plain = text.replace("\\\\", "").replace('\\"', "") if "\\" in text else text
    quotes = plain.count('"')
    if quotes > 4 * MAX_ELEMENTS + 4:
        return None
    return _QUOTED.sub("", plain) if quotes else plain


def _nests_deeper(outside: str | None) -> bool:
    """Whether the brackets of `outside` (JSON without its strings) nest more
    than MAX_NESTING deep.

    The brackets are kept (UTF-8 has no other byte of their values), then each
    pass removes the innermost pairs: one level. An unbalanced frame is too
    deep when it opens more than MAX_NESTING (``json.loads`` would recurse
    into each before failing).
    """
    if outside is None:
        return False  # too wide: refused after
    brackets = outside.encode("utf-8", "surrogatepass")
    brackets = brackets.translate(_AS_BRACKETS, _NOT_BRACKETS)
    for _ in range(MAX_NESTING):
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break
        brackets = shorter
    else:
        if b"[]" in brackets:
            return True  # a pair still inside MAX_NESTING others
    return brackets.count(b"[") > MAX_NESTING


def _checked_fields(
    type_name: str, cls: type, checks: dict[str, Any], data: dict[str, Any]
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, check in checks.items():
        if name not in data:
            if name in _REQUIRED[cls]:
                raise ProtocolError(f"{type_name}: missing field {name!r}")
            continue
        try:
            values[name] = check(data[name])
        except ProtocolError as exc:
            raise ProtocolError(f"{type_name}.{name}: {exc}") from None
    return values


def websocket_url(server_base_url: str, name: str | None = None) -> str:
    """Return the worker WebSocket URL under a gateway base URL.

    ``http`` becomes ``ws`` and ``https`` ``wss``; a path prefix is kept
    (``https://h/nexus`` -> ``wss://h/nexus/ws/workers/``). ``name`` goes in the
    query. Raises ValueError for another scheme or a URL without a host.
    """
    parts = urlsplit(server_base_url.strip())
    scheme = _WS_SCHEMES.get(parts.scheme.lower())
    if scheme is None or not parts.netloc:
        raise ValueError(
            f"{server_base_url!r} is not an http(s) URL of the gateway "
            "(like http://gateway:8000)"
        )
    path = parts.path.rstrip("/") + WEBSOCKET_PATH
    query = urlencode({NAME_QUERY_PARAM: name}) if name else ""
    return urlunsplit((scheme, parts.netloc, path, query, ""))


_WS_SCHEMES = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}


# Field checks: each returns the value (numbers as their Python type) or raises.
def _text(max_len: int | None = None, min_len: int = 0) -> Any:
    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise ProtocolError("not a string")
        if len(value) < min_len:
            raise ProtocolError("empty")
        if max_len is not None and len(value) > max_len:
            raise ProtocolError(f"longer than {max_len} characters")
        return value

    return check


def _integer(low: int, high: int) -> Any:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError("not an integer")
        if not low <= value <= high:
            raise ProtocolError(f"{value} is not in {low}..{high}")
        return value

    return check


def _number(low: float, high: float) -> Any:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError("not a number")
        if not low <= value <= high:
            raise ProtocolError(f"{value} is not in {low:g}..{high:g}")
        return float(value)

    return check


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError("not a boolean")
    return value


def _optional(check: Any) -> Any:
    def optional(value: Any) -> Any:
        return None if value is None else check(value)

    return optional


def _models(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise ProtocolError("not a list")
    if len(value) > _MAX_MODELS:
        raise ProtocolError(f"more than {_MAX_MODELS} models")
    check = _text(MAX_MODEL_NAME, min_len=1)
    return [check(item) for item in value]


def _headers(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ProtocolError("not an object")
    if len(value) > _MAX_HEADERS:
        raise ProtocolError(f"more than {_MAX_HEADERS} headers")
    check_name = _text(_MAX_HEADER_NAME, min_len=1)
    check_value = _text(_MAX_HEADER_VALUE)
    return {check_name(key): check_value(item) for key, item in value.items()}


def _record(cls: type, checks: dict[str, Any]) -> Any:
    """Check a JSON object into `cls` (unknown members ignored: a newer peer)."""

    required = {item.name for item in fields(cls) if item.default is MISSING}

    def check(value: Any) -> Any:
        if not isinstance(value, dict):
            raise ProtocolError("not an object")
        values: dict[str, Any] = {}
        for name, field_check in checks.items():
            if name in value:
                try:
                    values[name] = field_check(value[name])
                except ProtocolError as exc:
                    raise ProtocolError(f"{name}: {exc}") from None
            elif name in required:
                raise ProtocolError(f"missing field {name!r}")
        return cls(**values)

    return check


_BYTES = _optional(_integer(1, MAX_MEMORY_BYTES))
_LOADED_MODEL = _record(
    LoadedModel,
    {
        "name": _text(MAX_MODEL_NAME, min_len=1),
        "vram_bytes": _BYTES,
        "context_length": _optional(_integer(1, _MAX_CONTEXT)),
        "expires_in": _optional(_number(0.0, MAX_EXPIRES_IN)),
    },
)


def _loaded(value: Any) -> tuple[LoadedModel, ...]:
    if not isinstance(value, list):
        raise ProtocolError("not a list")
    if len(value) > MAX_LOADED_MODELS:
        raise ProtocolError(f"more than {MAX_LOADED_MODELS} models")
    models: dict[str, LoadedModel] = {}
    for entry in value:
        model = _LOADED_MODEL(entry)
        models.setdefault(model.name, model)  # a name twice: the first counts
    return tuple(models.values())


_SLOTS = _optional(_integer(0, _MAX_CONCURRENCY))
_STATE = _optional(
    _record(
        BackendState,
        {
            "loaded": _optional(_loaded),
            "memory_bytes": _BYTES,
            "slots": _SLOTS,
            "busy_slots": _SLOTS,
        },
    )
)
_ID = _text(_MAX_ID, min_len=1)
_LOAD = _integer(0, _MAX_LOAD)
_VERSION = _integer(0, 1_000_000)
_TIMESTAMP = _number(0.0, 1e12)
_BODY = _text()  # bounded by the frame

_CHECKS: dict[type, dict[str, Any]] = {
    Register: {
        "name": _text(_MAX_NAME, min_len=1),
        "models": _models,
        "max_concurrency": _integer(1, _MAX_CONCURRENCY),
        "load": _LOAD,
        "protocol_version": _VERSION,
        "backend_kind": _optional(_text(_MAX_SHORT)),
        "version": _optional(_text(_MAX_SHORT)),
        "state": _STATE,
    },
    ModelsUpdate: {"models": _models, "load": _LOAD},
    ResponseChunk: {"request_id": _ID, "chunk": _BODY},
    ResponseComplete: {
        "request_id": _ID,
        "status": _integer(100, 599),
        "headers": _headers,
        "body": _optional(_BODY),
    },
    Pong: {"timestamp": _optional(_TIMESTAMP), "load": _LOAD, "state": _STATE},
    Error: {
        "message": _text(_MAX_MESSAGE),
        "request_id": _optional(_ID),
        "code": _optional(_text(_MAX_SHORT)),
    },
    RegisterAck: {
        "worker_id": _ID,
        "models": _models,
        "protocol_version": _VERSION,
        "heartbeat_interval": _number(0.01, 3600.0),
    },
    Request: {
        "request_id": _ID,
        "model": _text(MAX_MODEL_NAME, min_len=1),
        "endpoint": _text(_MAX_HEADER_NAME, min_len=1),
        "method": _text(16, min_len=1),
        "body": _BODY,
        "headers": _headers,
        "is_streaming": _boolean,
    },
    Cancel: {"request_id": _ID, "reason": _text(_MAX_MESSAGE)},
    Ping: {"timestamp": _TIMESTAMP, "interval": _optional(_number(0.01, 3600.0))},
    GracefulShutdown: {
        "reason": _optional(_text(_MAX_MESSAGE)),
        "timeout_secs": _optional(_number(0.0, 7 * 24 * 3600.0)),
    },
    ModelsRefresh: {},
}
_SPECS: dict[str, tuple[Any, dict[str, Any]]] = {
    cls.type: (cls, checks)  # type: ignore[attr-defined]
    for cls, checks in _CHECKS.items()
}
_REQUIRED: dict[type, frozenset[str]] = {
    cls: frozenset(
        item.name
        for item in fields(cls)
        if item.default is MISSING and item.default_factory is MISSING
    )
    for cls in _CHECKS
}
