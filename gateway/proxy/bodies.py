"""Reading a client's request body: within its limits, parsed and checked.

The body is cut at the gateway's size limit as it arrives (413) and must
arrive in time (408); it must then be a JSON object of the endpoint's shape
(400 on anything wrong). Daphne hands over a body already whole (it enforces
both limits before the application runs).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.proxy.errors import ProxyError, bad_request

Receive = Callable[[], Awaitable[dict[str, Any]]]


class ClientGone(Exception):
    """The client disconnected while we were still reading its request."""


async def read_body(receive: Receive, limit: int, timeout: float) -> bytes:
    """Return the request's body, cut at `limit` bytes (413) as it arrives, and
    within `timeout` seconds (408: a client dripping it)."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
                if not message.get("more_body"):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except TimeoutError:
        raise ProxyError(
            408, "The request body did not arrive in time.", code="request_timeout"
        ) from None


def too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"The request body is larger than this gateway accepts ({limit} bytes).",
        code="request_too_large",
    )


def parse_object(
    raw: bytes, parse: Callable[[bytes], Any] = json.loads
) -> dict[str, Any]:
    """Decode a request body that must be a JSON object (400 if it is not)."""
    try:
        payload = parse(raw)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        raise bad_request(
            "We could not parse the JSON body of your request. The body must be "
            "valid JSON (and set 'Content-Type: application/json')."
        ) from None
    if not isinstance(payload, dict):
        raise bad_request("The request body must be a JSON object.")
    return payload


def parse_body(raw: bytes, endpoint: str) -> dict[str, Any]:
    """Decode and check the shape of an OpenAI request body (400 on anything wrong)."""
    payload = parse_object(raw)
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")
    if endpoint == "chat":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request(
                "'messages' must be a non-empty array of message objects.",
                param="messages",
            )
        if not all(isinstance(m, dict) for m in messages):
            raise bad_request(
                "Each item of 'messages' must be an object.", param="messages"
            )
    elif endpoint == "completions":
        if not isinstance(payload.get("prompt"), str | list):
            raise bad_request("'prompt' must be a string or an array.", param="prompt")
    elif not isinstance(payload.get("input"), str | list) or not payload["input"]:
        raise bad_request("'input' must be a non-empty string or array.", param="input")
    if endpoint == "embeddings" and stream:
        raise bad_request("Embeddings cannot be streamed.", param="stream")
    return payload
