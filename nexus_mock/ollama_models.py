"""Ollama's model management, as the mock's ``ollama`` kind answers it.

``POST /api/pull``, ``/api/push`` and ``/api/create`` stream NDJSON progress
lines (one object a line, the last ``{"status": "success"}``) unless
``"stream": false``, when only that last object is sent, as late as the
stream would have ended (``chunk_delay_ms`` a line); ``POST /api/copy``
and ``DELETE /api/delete`` answer 200 with an empty body. Errors are
``{"error": "..."}``: 400 for a body that is not what Ollama takes, 404 for a
model the node does not have (the source of a copy or a create, what is
pushed or deleted), 405 for the wrong method.

``HEAD /api/blobs/<digest>`` answers 200 when the node has that model file,
404 when not; ``POST`` stores it (201; 200 if it was there already; 400 when
the body's SHA-256 is not the digest), and a create's ``files`` must name
stored ones (400). Only the digests are kept, never the bytes.

Pulling any name succeeds (the mock is its own registry). The node's model
list changes only once the operation is over (a pull's or create's stream
fully sent), which ``ManagedModels.after`` says; the server applies it, and
``/api/tags``, ``/v1/models`` and inference see the change from then on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from nexus_mock.http_parsing import Request
from nexus_mock.jobs import ApiError, parse_json_object
from nexus_mock.ollama_api import NDJSON_CONTENT_TYPE, ollama_error
from nexus_mock.replies import encode_json

MANAGEMENT_PATHS = frozenset(
    {"/api/pull", "/api/push", "/api/copy", "/api/delete", "/api/create"}
)
# How many progress lines a pull's or push's layer takes, and its made-up size.
_PROGRESS_STEPS = 4
_LAYER_BYTES = 4_661_224_676


@dataclass(frozen=True, slots=True)
class ManagedModels:
    """A management request's reply, and the node's models once it is sent.

    ``lines`` are the operation's NDJSON progress lines: streamed one by one,
    or, when ``stream`` is off, only the last one is sent once the others'
    time has passed (Ollama says nothing until a pull without a stream is
    over). ``body`` is the whole reply of an operation without progress
    (copy, delete). ``after`` is the model list to apply once the reply has
    gone out (None: unchanged).
    """

    lines: tuple[bytes, ...] = ()
    stream: bool = True
    body: bytes | None = None
    after: tuple[str, ...] | None = None
    content_type: str = NDJSON_CONTENT_TYPE


def answer_management(
    request: Request, models: Sequence[str], blobs: Collection[str] = ()
) -> ManagedModels:
    """Answer a management request against the node's `models` (and the model
    files it holds, `blobs`).

    Raises ApiError (Ollama's shape) for a refused request.
    """
    path = request.path
    wanted = "DELETE" if path == "/api/delete" else "POST"
    if request.method != wanted:
        raise ollama_error(405, "405 method not allowed")
    try:
        payload = parse_json_object(request.body)
    except ApiError:
        raise ollama_error(400, "invalid character in request body") from None
    if path == "/api/copy":
        return _copy(payload, models)
    model = _name(payload, "model")
    if path == "/api/delete":
        if model not in models:
            raise ollama_error(404, f"model '{model}' not found")
        return ManagedModels(body=b"", after=tuple(m for m in models if m != model))
    stream = payload.get("stream", True)
    if not isinstance(stream, bool):
        raise ollama_error(400, "stream must be a boolean")
    if path == "/api/pull":
        lines = _pull_lines(model)
        after = models if model in models else (*models, model)
    elif path == "/api/push":
        if model not in models:
            raise ollama_error(404, f'model "{model}" not found')
        lines = _push_lines(model)
        after = None
    else:
        lines = _create_lines(payload, models, blobs)
        after = models if model in models else (*models, model)
    if after is not None:
        after = tuple(after)
    return ManagedModels(lines=lines, stream=stream, after=after)


def _name(payload: dict[str, Any], key: str) -> str:
    # Older clients send "name" where newer ones send "model".
    value = payload.get(key) or (payload.get("name") if key == "model" else None)
    if not isinstance(value, str) or not value.strip():
        raise ollama_error(400, f"{key} is required")
    return value.strip()


def _copy(payload: dict[str, Any], models: Sequence[str]) -> ManagedModels:
    source = _name(payload, "source")
    destination = _name(payload, "destination")
    if source not in models:
        raise ollama_error(404, f"model '{source}' not found")
    after = models if destination in models else (*models, destination)
    return ManagedModels(body=b"", after=tuple(after))


def _digest(model: str) -> str:
    return "sha256:" + hashlib.sha256(model.encode()).hexdigest()


def _line(**fields: Any) -> bytes:
    return encode_json(fields) + b"\n"


def _pull_lines(model: str) -> tuple[bytes, ...]:
    digest = _digest(model)
    progress = [
        _line(
            status=f"pulling {digest[7:19]}",
            digest=digest,
            total=_LAYER_BYTES,
            completed=_LAYER_BYTES * step // _PROGRESS_STEPS,
        )
        for step in range(_PROGRESS_STEPS + 1)
    ]
    return (
        _line(status="pulling manifest"),
        *progress,
        _line(status="verifying sha256 digest"),
        _line(status="writing manifest"),
        _line(status="success"),
    )


def _push_lines(model: str) -> tuple[bytes, ...]:
    digest = _digest(model)
    return (
        _line(status="retrieving manifest"),
        _line(status="starting upload", digest=digest, total=_LAYER_BYTES),
        _line(
            status="pushing " + digest[7:19],
            digest=digest,
            total=_LAYER_BYTES,
            completed=_LAYER_BYTES,
        ),
        _line(status="pushing manifest"),
        _line(status="success"),
    )


def _create_lines(
    payload: dict[str, Any], models: Sequence[str], blobs: Collection[str]
) -> tuple[bytes, ...]:
    base = payload.get("from")
    files = payload.get("files")
    if base is None and not files:
        raise ollama_error(400, "neither 'from' or 'files' was specified")
    if base is not None:
        if not isinstance(base, str) or not base:
            raise ollama_error(400, "from must be a model name")
        if base not in models:
            raise ollama_error(404, f"model '{base}' not found")
    if files is not None and not isinstance(files, dict):
        raise ollama_error(400, "files must be an object of file names to digests")
    for digest in (files or {}).values():
        if digest not in blobs:
            raise ollama_error(400, f"blob {digest} not found")
    lines = [_line(status="using existing layer " + _digest(str(base or files)))]
    for key in ("system", "template", "parameters", "license", "messages"):
        if payload.get(key):
            lines.append(_line(status="creating new layer " + _digest(key)))
    lines += [_line(status="writing manifest"), _line(status="success")]
    return tuple(lines)


BLOBS_PREFIX = "/api/blobs/"


def answer_blob(request: Request, blobs: set[str]) -> tuple[int, bytes]:
    """Answer ``HEAD`` or ``POST /api/blobs/<digest>``; a stored file's digest
    goes into `blobs`. Raises ApiError (Ollama's shape) for a refused one."""
    digest = request.path[len(BLOBS_PREFIX) :].replace("sha256-", "sha256:", 1)
    if request.method not in ("HEAD", "POST"):
        raise ollama_error(405, "405 method not allowed")
    if not digest.startswith("sha256:") or len(digest) != 71:
        raise ollama_error(400, "invalid digest format")
    if request.method == "HEAD":
        return (200 if digest in blobs else 404), b""
    if digest in blobs:
        return 200, b""
    got = "sha256:" + hashlib.sha256(request.body).hexdigest()
    if got != digest:
        raise ollama_error(400, f"digest mismatch, expected {digest!r}, got {got!r}")
    blobs.add(digest)
    return 201, b""
