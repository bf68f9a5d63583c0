"""Upstream replies are data to check, never passed on on trust.

A backend is a program the gateway does not control: it may answer a success
that is not JSON, an HTML error page holding its internals, a body of hundreds
of megabytes, or a stream whose events never end. The functions here decide,
from bytes already read, whether a reply is what the surface expects, and turn
anything else into the gateway's own error:

* ``check_reply_body()``: a non-stream 2xx must be the JSON object the endpoint
  answers (``choices`` for chat and completions, ``data`` for embeddings);
  otherwise ``UpstreamFault("upstream_invalid_response")``, which the proxy
  counts against the backend like a 5xx and retries elsewhere.
* ``check_first_event()``: the first data event of a stream must be JSON.
* ``error_reply()``: an upstream error in OpenAI's JSON shape is relayed (its
  message helps the client, e.g. "context too long"), reduced to the four
  fields of that shape; anything else becomes a neutral error of Nexus's own
  with the upstream status, and the raw body goes to the log, truncated.
* ``read_capped()``: read a whole reply, at most ``limit`` bytes.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

from gateway.proxy.errors import error_body

logger = logging.getLogger(__name__)

# How much of a rejected upstream body the log keeps.
LOGGED_BODY_BYTES = 1024
_EXPECTED_LIST = {"chat": "choices", "completions": "choices", "embeddings": "data"}


class UpstreamFault(Exception):
    """A reply that is the backend's fault (the next candidate may do better)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def invalid(detail: str) -> UpstreamFault:
    return UpstreamFault("upstream_invalid_response", detail)


def check_reply_body(endpoint: str, body: bytes) -> dict[str, Any]:
    """Return the parsed 2xx body, or raise UpstreamFault if it is not valid."""
    try:
        payload = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        raise invalid("answered a success that is not JSON") from None
    if not isinstance(payload, dict):
        raise invalid("answered a success that is not a JSON object")
    expected = _EXPECTED_LIST.get(endpoint)
    if expected is not None and not isinstance(payload.get(expected), list):
        raise invalid(f"answered a success without a '{expected}' list")
    return payload


def first_data_of(events: bytes) -> bytes | None:
    """The data of the first event in `events` that has any (None: only comments)."""
    for line in events.splitlines():
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


def check_first_event(events: bytes) -> bool:
    """Check the first data event of a stream; False if `events` has none yet.

    Raises UpstreamFault if it is neither JSON nor ``[DONE]``.
    """
    data = first_data_of(events)
    if data is None:
        return False
    if data == b"[DONE]":
        return True
    try:
        payload = json.loads(data)
    except ValueError:
        raise invalid("sent a stream whose first event is not JSON") from None
    if not isinstance(payload, dict):
        raise invalid("sent a stream whose first event is not a JSON object")
    return True


def check_first_line(lines: bytes) -> bool:
    """Check the first line of an NDJSON stream; False if `lines` has none yet.

    Raises UpstreamFault if it is not a JSON object.
    """
    line = next((line for line in lines.splitlines() if line.strip()), None)
    if line is None:
        return False
    try:
        payload = json.loads(line)
    except ValueError:
        raise invalid("sent a stream whose first line is not JSON") from None
    if not isinstance(payload, dict):
        raise invalid("sent a stream whose first line is not a JSON object")
    return True


def error_reply(
    status: int, content_type: str, body: bytes, backend: str, request_id: str
) -> tuple[bytes, str]:
    """Return the body a client gets for an upstream error, and the error code.

    An OpenAI-shaped JSON error keeps its message, type, param and code (and
    nothing else); any other body is logged (truncated) and replaced.
    """
    error = _openai_error(body) if "json" in content_type.lower() else None
    if error is not None:
        code = error.get("code")
        return (
            error_body(
                str(error.get("message")),
                str(error.get("type") or "upstream_error"),
                error.get("param") if isinstance(error.get("param"), str) else None,
                code if isinstance(code, str) else None,
            ),
            f"upstream_{status}",
        )
    logger.warning(
        "Backend %s answered HTTP %d with a body that is not an OpenAI error "
        "(request %s, %d bytes, %s): %r",
        backend,
        status,
        request_id,
        len(body),
        content_type[:100],
        body[:LOGGED_BODY_BYTES],
    )
    message = (
        f"The backend '{backend}' answered HTTP {status} with an error the gateway "
        f"does not pass on; the gateway's log has it (request id {request_id})."
    )
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return error_body(message, kind, None, "upstream_error"), f"upstream_{status}"


def json_object_of(body: bytes) -> dict[str, Any] | None:
    """The JSON object `body` holds, or None (not JSON, not UTF-8, not an object)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return payload if isinstance(payload, dict) else None


def _openai_error(body: bytes) -> dict[str, Any] | None:
    payload = json_object_of(body)
    error = payload.get("error") if payload is not None else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error
    return None


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """Read a whole reply body of at most `limit` bytes.

    Raises UpstreamFault("upstream_reply_too_large") as soon as the declared
    length or the bytes received pass the limit (the caller drops the
    connection), and aiohttp's errors for a broken transfer.
    """
    declared = response.content_length
    if declared is not None and declared > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    content = response.content
    while True:
        chunk = await content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int) -> UpstreamFault:
    return UpstreamFault(
        "upstream_reply_too_large",
        f"answered with a body over the gateway's limit ({limit} bytes)",
    )


def event_too_large(limit: int) -> UpstreamFault:
    return UpstreamFault(
        "upstream_event_too_large",
        f"sent a stream event over the gateway's limit ({limit} bytes)",
    )
