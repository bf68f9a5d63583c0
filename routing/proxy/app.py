"""The OpenAI-compatible gateway under /v1: a plain ASGI app on the hot path.

Nothing here touches the ORM, blocks, or builds an HTTP client per request: it
reads the gateway's immutable state (routing/state.py), asks the router for a
backend, and relays the backend's answer as it arrives.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from routing.core import RequestRequirements, RoutingError
from routing.metrics import UNKNOWN
from routing.proxy import limits
from routing.proxy.errors import (
    ProxyError,
    bad_request,
    method_not_allowed,
    not_found,
    unauthorized,
)
from routing.proxy.models_list import ModelsList
from routing.proxy.upstream import Exchange, forward
from routing.state import GatewayState
from usage.buffer import UsageEvent, new_event_id
from usage.limits.limiter import Ticket
from usage.limits.policy import FREE, KeyPolicy

if TYPE_CHECKING:
    from routing.gateway import Gateway

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("nexus.access")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

INFERENCE_ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
MODELS_PATH = "/v1/models"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# Status recorded when the client went away before the answer was complete.
CLIENT_CLOSED = 499


class ClientGone(Exception):
    """The client disconnected while we were still reading its request."""


class ProxyApp:
    """ASGI application for every path under /v1, serving with one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.max_body = gateway.config.max_body_bytes
        self.auth_required = gateway.config.auth_required
        self.access_log = gateway.config.access_log
        self.default_completion = gateway.config.default_completion_tokens
        self.models = ModelsList()

    async def __call__(
        self, scope: dict[str, Any], receive: Receive, send: Send
    ) -> None:
        gateway = self.gateway
        gateway.ensure_started()
        gateway.request_started()
        try:
            await self._serve(scope, receive, send)
        finally:
            gateway.request_finished()

    async def _serve(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        authorization = request_id = content_length = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"x-request-id":
                request_id = value
            elif name == b"content-length":
                content_length = value
        rid = _request_id(request_id)
        headers: Headers = [(b"x-request-id", rid.encode())]
        path, method = scope["path"], scope["method"]
        try:
            endpoint = INFERENCE_ENDPOINTS.get(path)
            if (
                endpoint is None
                and path != MODELS_PATH
                and not path.startswith(MODELS_PATH + "/")
            ):
                raise not_found(path)
            allowed = "POST" if endpoint is not None else "GET"
            if method != allowed:
                raise method_not_allowed(method, path)
            if self.gateway.draining:
                headers += ((b"connection", b"close"), (b"retry-after", b"1"))
                raise ProxyError(
                    503,
                    "This Nexus server is shutting down; retry the request.",
                    error_type="server_error",
                    code="shutting_down",
                )
            state = await self._gateway_state()
            key_prefix = self._authenticate(state, authorization)
            policy = state.policies.get(key_prefix) if key_prefix else None
            if policy is not None and policy.expires_at is not None:
                limits.check_expiry(policy, time.time(), self.gateway.metrics)
            if endpoint is not None:
                self._check_length(content_length)
                await self._inference(
                    state,
                    endpoint,
                    path,
                    key_prefix,
                    policy,
                    rid,
                    headers,
                    receive,
                    send,
                )
            elif path == MODELS_PATH:
                body = self.models.body(state.routes, policy)
                await _send_json(send, 200, body, headers)
            else:
                model_id = path[len(MODELS_PATH) + 1 :]
                entry = self.models.entry(state.routes, model_id, policy)
                if entry is None:
                    raise ProxyError(
                        404,
                        f"The model '{model_id}' does not exist",
                        param="model",
                        code="model_not_found",
                    )
                await _send_json(send, 200, entry, headers)
        except ProxyError as error:
            await _send_json(send, error.status, error.body(), headers)
        except ClientGone:
            pass

    async def _gateway_state(self) -> GatewayState:
        state = self.gateway.snapshots.peek()
        if state is not None:
            return state
        try:
            return await self.gateway.snapshots.current()
        except Exception as error:
            # Only the first request of a process builds the state; a database
            # that is down or not migrated must not turn into a bare 500.
            logger.exception("Could not load the gateway configuration")
            raise ProxyError(
                503,
                "The gateway could not load its configuration; retry shortly.",
                error_type="server_error",
                code="configuration_unavailable",
            ) from error

    def _record(
        self,
        exchange: Exchange,
        state: GatewayState,
        key_prefix: str,
        estimated_prompt: int,
        ticket: Ticket | None,
    ) -> None:
        """Hand the request's usage to the gateway (memory only, no I/O)."""
        usage = exchange.usage or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens", 0)
        reported = isinstance(prompt, int) and isinstance(completion, int)
        if not reported:
            if exchange.backend:
                prompt = estimated_prompt
                completion = -(-exchange.completion_chars // 4)  # ceil(chars / 4)
            else:
                # No backend answered: nothing was processed, nothing is billed.
                prompt = completion = 0
        assert isinstance(prompt, int) and isinstance(completion, int)
        total = usage.get("total_tokens") if reported else None
        total = total if isinstance(total, int) else prompt + completion
        cost = 0
        if exchange.backend:
            cost = state.prices.get(exchange.served_model, FREE).cost(
                prompt, completion
            )
        gateway = self.gateway
        if ticket is not None:
            gateway.limiter.settle(ticket, total, cost)
        if cost:
            gateway.metrics.observe_spend(key_prefix, cost)
        now = time.perf_counter()
        event = UsageEvent(
            request_id=exchange.request_id,
            endpoint=exchange.endpoint,  # type: ignore[arg-type]
            api_key_prefix=key_prefix,
            backend=exchange.backend,
            requested_model=exchange.requested_model,
            served_model=exchange.served_model,
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=total,
            estimated=not reported and bool(exchange.backend),
            latency_ms=(now - exchange.started) * 1000,
            status=exchange.status,
            streamed=exchange.stream,
            error=exchange.error,
            cost_nanos=cost,
        )
        gateway.buffer.append(event)
        gateway.live_usage.record(event)
        model = exchange.served_model or _known_model(state, exchange.requested_model)
        first_byte = exchange.first_byte
        gateway.metrics.observe_request(
            exchange.endpoint,
            model,
            exchange.backend,
            exchange.status,
            now - exchange.started,
            None if first_byte is None else first_byte - exchange.started,
            prompt,
            completion,
        )
        if self.access_log and access_logger.isEnabledFor(logging.INFO):
            access_logger.info(
                "request_id=%s endpoint=%s model=%s backend=%s status=%d "
                "latency_ms=%.1f tokens_in=%d tokens_out=%d retries=%d%s%s",
                exchange.request_id,
                exchange.endpoint,
                # Client-chosen: escaped so that it cannot forge log lines.
                exchange.requested_model[:128].encode("unicode_escape").decode(),
                exchange.backend or "-",
                exchange.status,
                event.latency_ms,
                prompt,
                completion,
                exchange.retries,
                " stream=1" if exchange.stream else "",
                f" error={exchange.error}" if exchange.error else "",
            )

    def _authenticate(self, state: GatewayState, authorization: bytes | None) -> str:
        """Return the client key's prefix ("" when auth is off and none is given)."""
        if authorization:
            scheme, _, token = authorization.partition(b" ")
            token = token.strip()
            if scheme.lower() == b"bearer" and token:
                # Looked up by SHA-256 digest: the stored secret is never compared
                # byte by byte, so timing reveals nothing about it.
                prefix = state.keys.get(hashlib.sha256(token).hexdigest())
                if prefix is not None:
                    return prefix
            if self.auth_required:
                shown = token[:6].decode(errors="replace")
                raise unauthorized(
                    f"Incorrect API key provided: {shown}…. Create keys with "
                    "`manage.py nexus_create_key` or in the admin."
                )
        if self.auth_required:
            raise unauthorized(
                "You didn't provide an API key. Send your Nexus key as "
                "'Authorization: Bearer <key>'."
            )
        return ""

    def _check_length(self, content_length: bytes | None) -> None:
        too_long = (
            content_length is not None
            and content_length.isdigit()
            and int(content_length) > self.max_body
        )
        if too_long:
            raise _too_large(self.max_body)

    async def _inference(
        self,
        state: GatewayState,
        endpoint: str,
        path: str,
        key_prefix: str,
        policy: KeyPolicy | None,
        request_id: str,
        headers: Headers,
        receive: Receive,
        send: Send,
    ) -> None:
        raw = await _read_body(receive, self.max_body)
        payload = _parse_body(raw, endpoint)
        try:
            requirements = RequestRequirements.from_request(payload)
        except RoutingError as error:
            raise _routing_error(error) from error
        exchange = Exchange(
            request_id=request_id,
            endpoint=endpoint,
            path=path,
            requested_model=requirements.model,
            stream=payload.get("stream") is True,
        )
        gateway = self.gateway
        ticket: Ticket | None = None
        try:
            if policy is not None:
                limits.check_model(
                    policy, state.routes, requirements.model, gateway.metrics
                )
            try:
                route = gateway.router.select(requirements, state.routes, gateway.stats)
            except RoutingError as error:
                raise _routing_error(error) from error
            if policy is not None and policy.is_limited:
                prompt = requirements.estimated_tokens
                completion = limits.completion_estimate(
                    payload, endpoint, self.default_completion
                )
                price = state.prices.get(route.target.model.name, FREE)
                ticket = await limits.admit(
                    gateway.limiter,
                    policy,
                    prompt + completion,
                    price.cost(prompt, completion),
                    headers,
                    gateway.metrics,
                )
                if exchange.stream and policy.has_budget:
                    exchange.meter = limits.BudgetMeter(
                        gateway.limiter, ticket, price, prompt
                    )
            await self._forward_watching_client(
                exchange, route, payload, raw, headers, receive, send
            )
        except ProxyError as error:
            exchange.status = error.status
            exchange.error = error.code or error.error_type
            raise
        finally:
            self._record(
                exchange, state, key_prefix, requirements.estimated_tokens, ticket
            )
            if exchange.error == "budget_exceeded":
                gateway.metrics.budget_cutoffs.inc()

    async def _forward_watching_client(
        self,
        exchange: Exchange,
        route: Any,
        payload: dict[str, Any],
        raw: bytes,
        headers: Headers,
        receive: Receive,
        send: Send,
    ) -> None:
        """Forward, and cancel the upstream request if the client hangs up."""
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(
            _cancel_on_disconnect(receive, task, exchange)
        )
        try:
            await forward(self.gateway, exchange, route, payload, raw, send, headers)
        except asyncio.CancelledError:
            if not exchange.client_gone:
                raise
            task.uncancel()
            exchange.status = CLIENT_CLOSED
            exchange.error = "client_closed"
        finally:
            watcher.cancel()


async def _cancel_on_disconnect(
    receive: Receive, task: asyncio.Task[Any], exchange: Exchange
) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            exchange.client_gone = True
            task.cancel()
            return


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"The request body is larger than this gateway accepts ({limit} bytes).",
        code="request_too_large",
    )


def _parse_body(raw: bytes, endpoint: str) -> dict[str, Any]:
    """Decode and check the shape of a request body (400 on anything wrong)."""
    try:
        payload = json.loads(raw)
    except ValueError:
        raise bad_request(
            "We could not parse the JSON body of your request. The body must be "
            "valid JSON (and set 'Content-Type: application/json')."
        ) from None
    if not isinstance(payload, dict):
        raise bad_request("The request body must be a JSON object.")
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


def _routing_error(error: RoutingError) -> ProxyError:
    body = error.to_openai()["error"]
    return ProxyError(
        error.status,
        body["message"],
        error_type=body["type"],
        param=body["param"],
        code=body["code"],
    )


def _request_id(value: bytes | None) -> str:
    if value:
        text = value.decode("latin-1")
        if _REQUEST_ID.fullmatch(text):
            return text
    return new_event_id()


def _known_model(state: GatewayState, model: str) -> str:
    """The model's name if the configuration knows it, else "unknown" (metrics)."""
    routes = state.routes
    if model in routes.routes or model in routes.aliases:
        return model
    return UNKNOWN


async def _send_json(send: Send, status: int, body: bytes, headers: Headers) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
