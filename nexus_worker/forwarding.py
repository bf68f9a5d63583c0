"""Forward one gateway request to the local backend and send its answer back.

A successful streamed response goes back as response_chunk frames as its bytes
arrive (decoded incrementally, so a chunk never splits a UTF-8 character), then
response_complete with body null. Anything else (not streamed, or an error
status) goes back whole in response_complete, or as chunks if it is too big for
one frame. The local backend failing before its first byte gives a 502 in
OpenAI's error shape; failing mid-stream gives a request-scoped error.
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from nexus_worker.backend import (
    BackendError,
    LocalBackend,
    iter_body,
    response_headers,
)
from nexus_worker.protocol import (
    ERROR_BACKEND_UNAVAILABLE,
    ERROR_RESPONSE_TOO_LARGE,
    MAX_CHUNK_CHARS,
    Error,
    Message,
    Request,
    ResponseChunk,
    ResponseComplete,
)

logger = logging.getLogger("nexus.worker")

# A single local response bigger than this is cut off with an error.
MAX_RESPONSE_BYTES = 32 * 1024 * 1024
TOO_LARGE = f"the local backend's response is over {MAX_RESPONSE_BYTES} bytes"

Send = Callable[[Message], Awaitable[None]]
# Run before the answer's last frame (model management: re-list the models,
# so that the gateway has the new list when the answer ends).
BeforeEnd = Callable[[], Awaitable[None]]


async def forward(
    backend: LocalBackend,
    request: Request,
    send: Send,
    before_end: BeforeEnd | None = None,
) -> None:
    """Serve ``request`` from ``backend``, sending every frame with ``send``
    (``before_end`` runs before response_complete, if given).

    Cancelling the task that runs this closes the backend connection at once.
    """
    request_id = request.request_id
    try:
        response = await backend.post(request)
    except BackendError as exc:
        logger.warning("request %s: %s", request_id, exc)
        await send(_failure(request_id, str(exc), ERROR_BACKEND_UNAVAILABLE))
        return
    try:
        if request.is_streaming and 200 <= response.status < 300:
            await _relay_stream(request_id, response, send, before_end)
        else:
            await _relay_whole(request_id, response, send, before_end)
    finally:
        # Unread (cancelled, cut off): this closes the backend connection.
        response.close()


async def _relay_stream(
    request_id: str,
    response: aiohttp.ClientResponse,
    send: Send,
    before_end: BeforeEnd | None,
) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    received = 0
    try:
        async for data in iter_body(response):
            received += len(data)
            if received > MAX_RESPONSE_BYTES:
                await send(
                    Error(
                        TOO_LARGE, request_id=request_id, code=ERROR_RESPONSE_TOO_LARGE
                    )
                )
                return
            await _send_chunks(request_id, decoder.decode(data), send)
    except BackendError as exc:
        logger.warning("request %s: %s", request_id, exc)
        await send(
            Error(str(exc), request_id=request_id, code=ERROR_BACKEND_UNAVAILABLE)
        )
        return
    await _send_chunks(request_id, decoder.decode(b"", final=True), send)
    if before_end is not None:
        await before_end()
    await send(
        ResponseComplete(
            request_id=request_id,
            status=response.status,
            headers=response_headers(response),
            body=None,
        )
    )


async def _relay_whole(
    request_id: str,
    response: aiohttp.ClientResponse,
    send: Send,
    before_end: BeforeEnd | None,
) -> None:
    body = bytearray()
    try:
        async for data in iter_body(response):
            body += data
            if len(body) > MAX_RESPONSE_BYTES:
                await send(_failure(request_id, TOO_LARGE, ERROR_RESPONSE_TOO_LARGE))
                return
    except BackendError as exc:
        await send(_failure(request_id, str(exc), ERROR_BACKEND_UNAVAILABLE))
        return
    text = body.decode("utf-8", errors="replace")
    inline = len(text) <= MAX_CHUNK_CHARS
    if not inline:
        # Too big for one frame: the body goes as chunks (see the protocol).
        await _send_chunks(request_id, text, send)
    if before_end is not None:
        await before_end()
    await send(
        ResponseComplete(
            request_id=request_id,
            status=response.status,
            headers=response_headers(response),
            body=text if inline else None,
        )
    )


async def _send_chunks(request_id: str, text: str, send: Send) -> None:
    for start in range(0, len(text), MAX_CHUNK_CHARS):
        piece = text[start : start + MAX_CHUNK_CHARS]
        await send(ResponseChunk(request_id=request_id, chunk=piece))


def _failure(request_id: str, detail: str, code: str) -> ResponseComplete:
    """A 502 in OpenAI's error shape for a request the local backend failed."""
    body = {
        "error": {
            "message": f"The worker's local backend failed: {detail}",
            "type": "server_error",
            "param": None,
            "code": code,
        }
    }
    return ResponseComplete(
        request_id=request_id,
        status=502,
        headers={"content-type": "application/json"},
        body=json.dumps(body),
    )
