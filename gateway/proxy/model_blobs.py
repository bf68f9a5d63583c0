"""Ollama's model files (blobs) through the gateway, for keys allowed to manage models.

``ollama create`` from a GGUF file (``Client.create(..., files=...)`` after
``create_blob``) first uploads the file: ``HEAD /api/blobs/<digest>`` asks
whether the server has it (200, or 404), ``POST /api/blobs/<digest>`` sends
it (201 once stored, 200 if it was there, 400 when the bytes do not hash to
the digest). Both go to the backend a management request would
(gateway/proxy/model_management.py: ``?backend=``, ``x-nexus-backend``, or
the only Ollama backend), under the same permission, and the backend's
answer comes back as it is.

The upload is streamed, never held in memory: under Daphne, which spools a
body to a temporary file before the application runs, the file is read on in
1 MiB pieces (``nexus.transport``'s ``body_file``,
nexus_site/servers/daphne_limits.py); under the other servers the body goes
on as it arrives. It may be up to ``NEXUS_MAX_BLOB_BYTES`` (413) and must
reach the backend within ``NEXUS_BLOB_TIMEOUT`` (504). A relay backend
cannot take one: its worker's frames carry text of at most 16 MiB
(nexus_worker/protocol.py), so such a request gets a 501 saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gateway.exchange import Headers
from gateway.proxy.bodies import ClientGone, Receive, too_large
from gateway.proxy.errors import ProxyError, method_not_allowed
from gateway.proxy.legs import ProxyExchange
from gateway.proxy.model_backends import (
    RELAY_KIND,
    check_may_manage,
    choose_backend,
    named_backend,
    unreachable,
)
from gateway.proxy.relays import Send
from gateway.proxy.replies import TRANSPORT_ERRORS, describe
from gateway.proxy.surfaces import OLLAMA_BLOBS_PREFIX
from routing.core import BackendSpec
from routing.state import GatewayState

if TYPE_CHECKING:
    from gateway.process import Gateway

logger = logging.getLogger(__name__)

BLOB_METHODS = ("HEAD", "POST")
# Ollama's digests: "sha256:" (or "sha256-", as in its file names) and 64 hex.
_DIGEST = re.compile(r"sha256[:-][0-9a-f]{64}")
PIECE_BYTES = 1024 * 1024
# The most of a backend's answer to an upload passed on (it is a status).
MAX_ANSWER_BYTES = 64 * 1024


class _Upload:
    """The request body on its way to the backend, counted and bounded."""

    def __init__(
        self, file: Any, receive: Receive, limit: int, length: int | None
    ) -> None:
        self.file = file
        self.receive = receive
        self.limit = limit
        self.length = length
        self.sent = 0
        # Why the body stopped short (the client's fault): raised once aiohttp
        # gives up sending it.
        self.error: ProxyError | ClientGone | None = None

    def size(self) -> int | None:
        """The body's length, when known before sending it."""
        if self.file is not None:
            self.file.seek(0, 2)
            size = int(self.file.tell())
            self.file.seek(0)
            return size
        return self.length

    async def pieces(self) -> AsyncIterator[bytes]:
        if self.file is not None:
            while piece := await asyncio.to_thread(self.file.read, PIECE_BYTES):
                self.sent += len(piece)
                yield piece
            return
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.error = ClientGone()
                raise self.error
            piece = message.get("body", b"")
            self.sent += len(piece)
            if self.sent > self.limit:
                self.error = too_large(self.limit)
                raise self.error
            if piece:
                yield piece
            if not message.get("more_body"):
                return


class ModelBlobs:
    """Pass Ollama's blob requests to the backend the operator names."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        config = gateway.config
        self.max_blob = config.max_blob_bytes
        self.timeout = config.blob_timeout

    async def serve(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        scope: dict[str, Any],
        receive: Receive,
        send: Send,
    ) -> None:
        """Answer one blob request of a key already identified."""
        method, path = scope["method"], exchange.path
        if method not in BLOB_METHODS:
            raise method_not_allowed(method, path)
        check_may_manage(exchange, self.gateway.draining)
        digest = path[len(OLLAMA_BLOBS_PREFIX) :]
        if not _DIGEST.fullmatch(digest):
            raise ProxyError(400, "invalid digest format", code="invalid_digest")
        backend = choose_backend(
            state, named_backend(exchange, scope.get("query_string", b""))
        )
        if backend.kind == RELAY_KIND:
            raise ProxyError(
                501,
                f"The backend '{backend.name}' is served through a relay worker, "
                "which cannot carry model files (its frames are text of at most "
                "16 MiB): create the model on the worker's machine, or name a "
                "backend Nexus reaches directly.",
                error_type="server_error",
                code="blob_not_relayed",
            )
        transport = (scope.get("extensions") or {}).get("nexus.transport") or {}
        upload = _Upload(
            transport.get("body_file"),
            receive,
            self.max_blob,
            _content_length(scope),
        )
        if upload.length is not None and upload.length > self.max_blob:
            raise too_large(self.max_blob)
        status, headers, body = await self._send(exchange, backend, method, upload)
        logger.info(
            "Model file %s %s on %s by %s: %s (%d bytes)",
            method,
            digest[:19],
            backend.name,
            exchange.key_prefix,
            status,
            upload.sent,
        )
        answer: Headers = [
            *headers,
            (b"content-length", str(len(body)).encode()),
            (b"x-nexus-backend", backend.name.encode()),
            *exchange.response_headers,
        ]
        await send({"type": "http.response.start", "status": status, "headers": answer})
        await send({"type": "http.response.body", "body": body})

    async def _send(
        self,
        exchange: ProxyExchange,
        backend: BackendSpec,
        method: str,
        upload: _Upload,
    ) -> tuple[int, Headers, bytes]:
        """The backend's answer to the request: status, headers, body."""
        upstream = self.gateway.upstream
        url = backend.base_url.removesuffix("/").removesuffix("/v1") + exchange.path
        headers = {"accept-encoding": "identity", "x-request-id": exchange.request_id}
        if backend.api_key:
            headers["authorization"] = f"Bearer {backend.api_key}"
        data = None
        if method == "POST":
            headers["content-type"] = "application/octet-stream"
            size = upload.size()
            if size is not None:
                headers["content-length"] = str(size)
            data = upload.pieces()
        try:
            async with asyncio.timeout(self.timeout):
                async with upstream.session.request(
                    method,
                    url,
                    data=data,
                    headers=headers,
                    timeout=upstream.timeout(backend.request_timeout),
                ) as response:
                    body = await response.content.read(MAX_ANSWER_BYTES)
                    status = response.status
                    content_type = response.headers.get("Content-Type", "")
        except TimeoutError:
            raise unreachable(backend, "timed out", 504) from None
        except TRANSPORT_ERRORS as error:
            if isinstance(upload.error, ProxyError):
                raise upload.error from None
            if isinstance(upload.error, ClientGone):
                raise upload.error from None
            raise unreachable(backend, describe(error), 502) from None
        if method == "HEAD":
            return status, [], b""
        if status >= 400 and not _is_ollama_error(body):
            # Not Ollama's shape (a proxy's page?): said in it, not relayed.
            body = json.dumps(
                {"error": f"The backend {backend.name} answered HTTP {status}."}
            ).encode()
            content_type = "application/json; charset=utf-8"
        headers_out: Headers = []
        if content_type:
            headers_out.append((b"content-type", content_type.encode("latin-1")))
        return status, headers_out, body


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() and len(text) < 20 else None
    return None


def _is_ollama_error(body: bytes) -> bool:
    try:
        decoded = json.loads(body)
    except ValueError:
        return False
    return isinstance(decoded, dict) and isinstance(decoded.get("error"), str)
