"""Ollama's model management through the gateway, for keys allowed to do it.

``POST /api/pull``, ``/api/push``, ``/api/copy``, ``/api/create`` and
``DELETE /api/delete`` change what an Ollama server holds, so they are not
routed like inference: the operator names the backend (``?backend=NAME`` or
the ``x-nexus-backend`` header; without either, the only enabled Ollama
backend), and only a client key with ``can_manage_models`` may ask. The
request body goes to that backend as it came; its answer comes back as it
goes, NDJSON progress line by line while the backend sends it (a pull may
stream for many minutes: no total timeout, only the backend's request
timeout between reads). A pull, push or create without a stream is asked of
the backend as a stream all the same, and answered with its last line once
it ends (a 500 if that is an error, as Ollama does), so that the same bound
between progress lines holds for it. Once the operation is over, model discovery runs for
that backend and this process's snapshot is rebuilt before the answer ends,
so the client's next ``/api/tags`` or chat sees the change. An Ollama server
behind a relay worker is managed through it when its owner allows it
(gateway/proxy/model_relay.py).

A client that leaves before the answer ends (Ctrl-C on ``ollama pull``) ends
the request to the backend at once, as leaving Ollama itself does: Ollama
stops the download and keeps the layers it has, so pulling again resumes.
Nothing of the request is left running in Nexus; discovery still runs for
the backend, in the background. Ollama's model files (``/api/blobs``, for
``/api/create``) go to the backend chosen the same way:
gateway/proxy/model_blobs.py.

Every refusal is in Ollama's error shape (``{"error": "..."}``, rendered by
the caller): 403 for a key without the permission (or no key), 404 for a
backend name that does not exist or no Ollama backend at all, 400 for a
backend that is not an Ollama server, two different names in the query and
the header, or several Ollama backends and none named; 502/504 when the
backend cannot be reached or stops answering before its answer began.

Calls are logged (key, backend, path, model, status), not recorded as usage:
they spend no tokens and name no served model, which usage rows count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from gateway.exchange import Headers
from gateway.model_discovery import discover_backend, read_version
from gateway.proxy.bodies import parse_object, read_body
from gateway.proxy.errors import method_not_allowed
from gateway.proxy.legs import ProxyExchange
from gateway.proxy.limits import check_model
from gateway.proxy.model_backends import (
    RELAY_KIND,
    check_may_manage,
    choose_backend,
    named_backend,
    unreachable,
)
from gateway.proxy.model_progress import Response, last_line
from gateway.proxy.model_relay import open_through_relay
from gateway.proxy.relays import STALL_POLL_SECONDS, Send
from gateway.proxy.replies import TRANSPORT_ERRORS, describe
from gateway.relay.dispatch import RelayResponse
from routing.core import BackendSpec
from routing.state import GatewayState

if TYPE_CHECKING:
    from gateway.process import Gateway

logger = logging.getLogger(__name__)

# The paths, and the method each takes (the ollama client deletes with DELETE).
MANAGEMENT_METHODS = {
    "/api/pull": "POST",
    "/api/push": "POST",
    "/api/copy": "POST",
    "/api/create": "POST",
    "/api/delete": "DELETE",
}
# Operations that report progress: asked of the backend as a stream even when
# the client wants one answer (the ollama client's default), so that a long
# pull is bounded by the time between progress lines, not by its length.
PROGRESS_PATHS = frozenset({"/api/pull", "/api/push", "/api/create"})
NDJSON = "application/x-ndjson"
# How long the answer's end waits for discovery and the snapshot rebuild; the
# operation is done by then, so a slow discovery only delays seeing it.
DISCOVERY_WAIT_SECONDS = 60.0
_MAX_NAME = 200
# Status recorded (in the log) when the client left before the answer ended.
CLIENT_CLOSED = 499


class ModelManagement:
    """Pass Ollama model management to the backend the operator names."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        config = gateway.config
        self.max_body = config.max_body_bytes
        self.body_timeout = config.client_body_timeout
        # Discoveries after an operation whose client left (see
        # _relay_watching_client): kept until done.
        self._discovering: set[asyncio.Task[None]] = set()

    async def serve(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        method: str,
        query: bytes,
        receive: Any,
        send: Send,
    ) -> None:
        """Answer one management request of a key already identified."""
        path = exchange.path
        if method != MANAGEMENT_METHODS[path]:
            raise method_not_allowed(method, path)
        policy = check_may_manage(exchange, self.gateway.draining)
        backend = choose_backend(state, named_backend(exchange, query))
        raw = await read_body(receive, self.max_body, self.body_timeout)
        payload = parse_object(raw)
        # A key limited to some models manages only those (a pull, a copy's
        # source and destination, a delete).
        for name in _models_named(payload):
            check_model(policy, state.routes, name, self.gateway.metrics)
        collapse = path in PROGRESS_PATHS and payload.get("stream") is False
        if collapse:
            raw = json.dumps({**payload, "stream": True}).encode()
        started = time.perf_counter()
        model = _model_of(payload)
        status = await self._relay_watching_client(
            exchange, backend, raw, model, receive, send, collapse
        )
        logger.info(
            "Model management by %s on %s: %s %s -> %s in %.1f s",
            exchange.key_prefix or "anonymous",
            backend.name,
            path,
            model,
            status,
            time.perf_counter() - started,
        )

    async def _relay_watching_client(
        self,
        exchange: ProxyExchange,
        backend: BackendSpec,
        raw: bytes,
        model: str,
        receive: Any,
        send: Send,
        collapse: bool,
    ) -> int:
        """``_relay``, ended at once when the client leaves (Ctrl-C on
        ``ollama pull``): the backend's connection is closed, so the backend
        sees its client go, as when Ollama is asked directly (Ollama then stops
        the pull and keeps the parts it has: pulling again resumes). Discovery
        still runs for the backend, in the background, so that whatever the
        operation changed before it ended is served."""
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(
            _cancel_on_disconnect(receive, task, exchange)
        )
        try:
            return await self._relay(exchange, backend, raw, model, send, collapse)
        except asyncio.CancelledError:
            if not exchange.client_gone:
                raise
            task.uncancel()
            self._rediscover_later(backend)
            return CLIENT_CLOSED
        finally:
            watcher.cancel()

    def _rediscover_later(self, backend: BackendSpec) -> None:
        """Run ``_rediscover`` in a task of its own (the request is over)."""
        task = asyncio.get_running_loop().create_task(
            self._rediscover(backend, ask=True)
        )
        self._discovering.add(task)
        task.add_done_callback(self._discovering.discard)

    async def _relay(
        self,
        exchange: ProxyExchange,
        backend: BackendSpec,
        raw: bytes,
        model: str,
        send: Send,
        collapse: bool,
    ) -> int:
        """Send the request on; relay the answer as it comes (or only its last
        line, when `collapse`); return the status the client got."""
        path = exchange.path
        if backend.kind == RELAY_KIND:
            relayed = await open_through_relay(
                self.gateway.relay,
                exchange,
                backend,
                MANAGEMENT_METHODS[path],
                raw,
                model,
                path in PROGRESS_PATHS,
            )
            try:
                return await self._answer_with(
                    exchange, backend, relayed, send, collapse
                )
            finally:
                relayed.close()
        upstream = self.gateway.upstream
        url = backend.base_url.removesuffix("/").removesuffix("/v1") + path
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            "x-request-id": exchange.request_id,
        }
        if backend.api_key:
            headers["authorization"] = f"Bearer {backend.api_key}"
        try:
            response = await upstream.session.request(
                MANAGEMENT_METHODS[path],
                url,
                data=raw,
                headers=headers,
                timeout=upstream.timeout(backend.request_timeout),
            )
        except TimeoutError:
            raise unreachable(backend, "timed out", 504) from None
        except TRANSPORT_ERRORS as error:
            raise unreachable(backend, describe(error), 502) from None
        async with response:
            return await self._answer_with(exchange, backend, response, send, collapse)

    async def _answer_with(
        self,
        exchange: ProxyExchange,
        backend: BackendSpec,
        response: Response,
        send: Send,
        collapse: bool,
    ) -> int:
        """Answer the client with the backend's response; return its status."""
        if collapse and response.status < 400:
            return await self._answer_once(exchange, backend, response, send)
        await self._answer(exchange, backend, response, send)
        return response.status

    async def _answer_once(
        self,
        exchange: ProxyExchange,
        backend: BackendSpec,
        response: Response,
        send: Send,
    ) -> int:
        """Read the backend's progress to its end; answer its last line alone.

        As Ollama answers a request without a stream: the final status, or
        a 500 with the error that ended it.
        """
        status, body = await last_line(backend, response)
        if status < 400 and exchange.path != "/api/push":
            await self._rediscover(backend)
        headers: Headers = [
            (b"content-type", b"application/json; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"x-nexus-backend", backend.name.encode()),
            *exchange.response_headers,
        ]
        await send(
            {"type": "http.response.start", "status": status, "headers": headers}
        )
        await send({"type": "http.response.body", "body": body})
        return status

    async def _answer(
        self,
        exchange: ProxyExchange,
        backend: BackendSpec,
        response: Response,
        send: Send,
    ) -> None:
        content_type = response.headers.get("Content-Type", "application/json")
        if isinstance(response, RelayResponse) and response.status < 400:
            content_type = NDJSON  # a relayed stream is headed as SSE
        response_headers: Headers = [
            (b"content-type", content_type.encode("latin-1")),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            (b"x-nexus-backend", backend.name.encode()),
            *exchange.response_headers,
        ]
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": response_headers,
            }
        )
        broken = await self._pass_body(exchange, response, send)
        if response.status < 400 and exchange.path != "/api/push":
            # Pushing leaves the backend's models as they were.
            await self._rediscover(backend)
        if broken:
            line = {"error": f"Nexus: the backend {backend.name} broke off: {broken}"}
            tail = json.dumps(line).encode() + b"\n"
        else:
            tail = b""
        if exchange.error == "client_stalled" and exchange.abort is not None:
            exchange.abort()
            return
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _pass_body(
        self, exchange: ProxyExchange, response: Response, send: Send
    ) -> str:
        """Relay the backend's body chunk by chunk; return why it broke ("": it
        ended). A client that leaves ``max_unsent`` bytes unread for
        ``stall_seconds`` stops the relay (the operation goes on at the
        backend until its own end is read, below)."""
        limits = self.gateway.upstream.limits
        unsent = exchange.unsent_bytes
        try:
            async for data in response.content.iter_any():
                await send(
                    {"type": "http.response.body", "body": data, "more_body": True}
                )
                if (
                    unsent is not None
                    and unsent() > limits.max_unsent
                    and await _stays_unread(
                        unsent, limits.max_unsent, limits.stall_seconds
                    )
                ):
                    exchange.error = "client_stalled"
                    return ""
        except TimeoutError:
            return "no data within its request timeout"
        except TRANSPORT_ERRORS as error:
            return describe(error)
        return ""

    async def _rediscover(self, backend: BackendSpec, *, ask: bool = False) -> None:
        """List the backend's models now and serve with them before answering.

        A relay worker has reported its models before its answer ended (or,
        when `ask`, is asked to): the configuration version now is served,
        which has them unless the worker's changes were coalesced into a
        later one (gateway/proxy/model_relay.py).
        """
        if backend.id is None:
            return
        try:
            async with asyncio.timeout(DISCOVERY_WAIT_SECONDS):
                if backend.kind != RELAY_KIND:
                    version = await asyncio.to_thread(discover_backend, backend.id)
                elif ask:
                    await self.gateway.relay.refresh_models(backend.name)
                    return
                else:
                    version = await asyncio.to_thread(read_version)
                await self.gateway.snapshots.catch_up(version)
        except Exception:
            logger.warning(
                "Discovery after model management on %s failed; the periodic "
                "discovery will pick the change up",
                backend.name,
                exc_info=True,
            )


def _models_named(payload: dict[str, Any]) -> list[str]:
    return [
        value
        for field in ("model", "name", "source", "destination")
        if isinstance(value := payload.get(field), str) and value
    ]


def _model_of(payload: dict[str, Any]) -> str:
    model = payload.get("model") or payload.get("name") or payload.get("source")
    return model[:_MAX_NAME] if isinstance(model, str) else "?"


async def _cancel_on_disconnect(
    receive: Any, task: asyncio.Task[Any], exchange: ProxyExchange
) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            exchange.client_gone = True
            task.cancel()
            return


async def _stays_unread(unsent: Any, max_unsent: int, stall_seconds: float) -> bool:
    """Whether the client leaves over half the bound unread for stall_seconds."""
    loop = asyncio.get_running_loop()
    until = loop.time() + stall_seconds
    while unsent() > max_unsent // 2:
        if loop.time() >= until:
            return True
        await asyncio.sleep(STALL_POLL_SECONDS)
    return False
