"""The gateway's client API: a plain ASGI app on the hot path.

It answers every inbound surface (gateway/proxy/surfaces.py): OpenAI's and
Anthropic's under /v1, and Ollama's native API at the root (``/``,
``/api/version``, ``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/chat``,
``/api/generate``, ``/api/embed``, ``/api/embeddings``).

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

from gateway.admission import BadAdmissionHeader
from gateway.fleet.errors import FleetRefusal
from gateway.metrics import UNKNOWN
from gateway.protocols import anthropic as anthropic_translate
from gateway.protocols.base import loads
from gateway.proxy import limits
from gateway.proxy.errors import (
    ProxyError,
    bad_request,
    method_not_allowed,
    not_found,
    unauthorized,
)
from gateway.proxy.legs import Call
from gateway.proxy.models_list import ModelsList
from gateway.proxy.ollama_catalog import OllamaCatalog
from gateway.proxy.surfaces import (
    ANTHROPIC,
    COUNT_TOKENS_PATH,
    ENDPOINTS,
    OLLAMA_INFO_PATHS,
    OLLAMA_UNSUPPORTED_PATHS,
    OLLAMA_VERSION,
    OPENAI,
    Surface,
)
from gateway.proxy.upstream import Exchange, forward
from routing.admission import AdmissionError
from routing.core import RequestRequirements, Route, RouterSnapshot, RoutingError
from routing.core.decision import Via
from routing.state import GatewayState
from usage.buffer import UsageEvent, new_event_id
from usage.limits.policy import FREE, KeyPolicy

if TYPE_CHECKING:
    from gateway.process import Gateway

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("nexus.access")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

MODELS_PATH = "/v1/models"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_NO_ENDPOINT: tuple[str | None, Surface] = (None, OPENAI)
# Status recorded when the client went away before the answer was complete.
CLIENT_CLOSED = 499
# Usage of a request no backend saw (refused or left while queued): nothing.
_NOTHING_BILLED = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


class ClientGone(Exception):
    """The client disconnected while we were still reading its request."""


class ProxyApp:
    """ASGI application for every path under /v1, serving with one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.max_body = gateway.config.max_body_bytes
        self.body_timeout = gateway.config.client_body_timeout
        self.auth_required = gateway.config.auth_required
        self.access_log = gateway.config.access_log
        self.default_completion = gateway.config.default_completion_tokens
        self.models = ModelsList()
        self.ollama_catalog = OllamaCatalog()

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
        authorization = request_id = content_length = api_key = None
        anthropic_client = False
        state: GatewayState | None = None
        key_prefix = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"x-request-id":
                request_id = value
            elif name == b"content-length":
                content_length = value
            elif name == b"x-api-key":
                api_key = value
            elif name == b"anthropic-version":
                anthropic_client = True
        rid = _request_id(request_id)
        headers: Headers = [(b"x-request-id", rid.encode())]
        path, method = scope["path"], scope["method"]
        endpoint, surface = ENDPOINTS.get(path, _NO_ENDPOINT)
        if path in OLLAMA_INFO_PATHS or path in OLLAMA_UNSUPPORTED_PATHS:
            surface = ENDPOINTS["/api/chat"][1]  # Ollama's error shape
        elif anthropic_client and endpoint is None:
            # Anthropic's SDK lists models at the same path (its Models API):
            # its key header, its shapes and its error shape.
            surface = ANTHROPIC
        try:
            if path in OLLAMA_INFO_PATHS or path in OLLAMA_UNSUPPORTED_PATHS:
                await self._ollama_info(
                    path, method, authorization, surface, headers, receive, send
                )
                return
            if path == COUNT_TOKENS_PATH:
                endpoint, surface = "count_tokens", ANTHROPIC
            elif (
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
            if api_key is not None and surface.accepts_x_api_key:
                authorization = b"Bearer " + api_key
            key_prefix = self._authenticate(state, authorization, surface)
            policy = state.policies.get(key_prefix) if key_prefix else None
            if policy is not None and policy.expires_at is not None:
                limits.check_expiry(policy, time.time(), self.gateway.metrics)
            if endpoint == "count_tokens":
                self._check_length(content_length)
                await self._count_tokens(state, policy, headers, receive, send)
            elif surface is not OPENAI and endpoint is not None:
                self._check_length(content_length)
                await self._translated(
                    state,
                    endpoint,
                    surface,
                    scope,
                    key_prefix,
                    rid,
                    headers,
                    receive,
                    send,
                )
            elif endpoint is not None:
                self._check_length(content_length)
                await self._inference(
                    state, endpoint, scope, key_prefix, rid, headers, receive, send
                )
            elif path == MODELS_PATH:
                if surface is ANTHROPIC:
                    query = scope.get("query_string", b"")
                    body = self.models.anthropic_page(state.routes, policy, query)
                else:
                    body = self.models.body(state.routes, policy)
                await _send_json(send, 200, body, headers)
            else:
                model_id = path[len(MODELS_PATH) + 1 :]
                entry = (
                    self.models.anthropic_entry(state.routes, model_id, policy)
                    if surface is ANTHROPIC
                    else self.models.entry(state.routes, model_id, policy)
                )
                if entry is None:
                    raise ProxyError(
                        404,
                        f"The model '{model_id}' does not exist",
                        param="model",
                        code="model_not_found",
                    )
                await _send_json(send, 200, entry, headers)
        except ProxyError as error:
            if (
                endpoint is not None
                and endpoint != "count_tokens"
                and not error.recorded
            ):
                # Refused before any backend (401, 413, a body that does not
                # parse, draining): a request and an error all the same.
                self._record_refusal(error, endpoint, path, rid, key_prefix, state)
            await _send_json(send, error.status, surface.error_body(error), headers)
        except ClientGone:
            pass

    def record_head_refusal(
        self, error: ProxyError, path: str, request_id: bytes | None
    ) -> str:
        """Count a request the server refused from its head alone; return its id.

        Daphne refuses uploads at the headers (nexus_site/servers/daphne_limits.py),
        before this app runs: such a refusal is a request and an error all the
        same, as when the proxy itself refuses.
        """
        rid = _request_id(request_id)
        endpoint = ENDPOINTS.get(path, _NO_ENDPOINT)[0]
        if endpoint is not None:
            self._record_refusal(
                error, endpoint, path, rid, "", self.gateway.snapshots.peek()
            )
        return rid

    def _record_refusal(
        self,
        error: ProxyError,
        endpoint: str,
        path: str,
        request_id: str,
        key_prefix: str,
        state: GatewayState | None,
    ) -> None:
        exchange = Exchange(
            request_id=request_id,
            endpoint=endpoint,
            path=path,
            requested_model="",
            stream=False,
            status=error.status,
            error=error.code or error.error_type,
        )
        self._record(exchange, state, key_prefix, 0)

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
        state: GatewayState | None,
        key_prefix: str,
        estimated_prompt: int,
    ) -> None:
        """Hand the request's usage to the gateway (memory only, no I/O)."""
        usage = exchange.usage or {}
        prompt = _token_count(usage.get("prompt_tokens"))
        completion = _token_count(usage.get("completion_tokens", 0))
        reported = prompt is not None and completion is not None
        if not exchange.backend:
            # Refused before any backend: no tokens were spent.
            prompt = completion = 0
            reported = True
        elif prompt is None or completion is None:
            prompt = estimated_prompt
            completion = -(-exchange.completion_chars // 4)  # ceil(chars / 4)
        total = _token_count(usage.get("total_tokens")) if reported else None
        if not isinstance(total, int):
            total = prompt + completion
        cost = 0
        if exchange.backend and state is not None:
            price = state.prices.get(exchange.served_model, FREE)
            cost = price.cost(prompt, completion)
        gateway = self.gateway
        if exchange.limit_ticket is not None:
            gateway.limiter.settle(exchange.limit_ticket, total, cost)
            exchange.limit_ticket = None
        if cost:
            gateway.metrics.observe_spend(key_prefix, cost)
        if exchange.error == "budget_exceeded":
            gateway.metrics.budget_cutoffs.inc()
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
            estimated=not reported,
            latency_ms=(now - exchange.started) * 1000,
            status=exchange.status,
            streamed=exchange.stream,
            error=exchange.error,
            cost_nanos=cost,
        )
        gateway.buffer.append(event)
        gateway.live_usage.record(event)
        model = exchange.served_model or (
            UNKNOWN if state is None else _known_model(state, exchange.requested_model)
        )
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

    def _authenticate(
        self, state: GatewayState, authorization: bytes | None, surface: Surface
    ) -> str:
        """Return the client key's prefix ("" when auth is off and none is given).

        Anthropic clients may send the key as ``x-api-key`` instead (the caller
        passes it here as a bearer token).
        """
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
                f"You didn't provide an API key. Send your Nexus key as "
                f"{surface.key_hint}."
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
        scope: dict[str, Any],
        key_prefix: str,
        request_id: str,
        headers: Headers,
        receive: Receive,
        send: Send,
    ) -> None:
        raw = await _read_body(receive, self.max_body, self.body_timeout)
        payload = _parse_body(raw, endpoint)
        try:
            requirements = RequestRequirements.from_request(payload)
        except RoutingError as error:
            raise _routing_error(error) from error
        exchange = Exchange(
            request_id=request_id,
            endpoint=endpoint,
            path=scope["path"],
            requested_model=requirements.model,
            stream=payload.get("stream") is True,
            unsent_bytes=_unsent_bytes_probe(scope),
        )
        await self._route_and_forward(
            state,
            exchange,
            requirements,
            key_prefix,
            payload,
            raw,
            None,
            headers,
            scope["headers"],
            receive,
            send,
        )

    async def _translated(
        self,
        state: GatewayState,
        endpoint: str,
        surface: Surface,
        scope: dict[str, Any],
        key_prefix: str,
        request_id: str,
        headers: Headers,
        receive: Receive,
        send: Send,
    ) -> None:
        """A request on a surface other than OpenAI's: made canonical to route."""
        raw = await _read_body(receive, self.max_body, self.body_timeout)
        payload = _parse_object(raw, loads)
        inbound = surface.to_canonical(payload)
        try:
            requirements = RequestRequirements.from_request(inbound.canonical)
        except RoutingError as error:
            raise _routing_error(error) from error
        if inbound.ready is not None:
            # Nothing for a backend to do (Ollama's "load the model"): answered
            # here once some backend could serve the model (and the key may).
            gateway = self.gateway
            policy = state.policies.get(key_prefix) if key_prefix else None
            if policy is not None:
                limits.check_model(
                    policy, state.routes, requirements.model, gateway.metrics
                )
            decision = gateway.router.explain(requirements, state.routes, gateway.stats)
            if decision.error is not None:
                raise _routing_error(decision.error)
            await _send_json(send, 200, inbound.ready, headers)
            return
        exchange = Exchange(
            request_id=request_id,
            endpoint=endpoint,
            path=scope["path"],
            requested_model=requirements.model,
            stream=inbound.stream,
            unsent_bytes=_unsent_bytes_probe(scope),
        )
        client_headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name.startswith(b"anthropic-")
        }
        call = Call(surface, inbound, payload, raw, client_headers)
        await self._route_and_forward(
            state,
            exchange,
            requirements,
            key_prefix,
            payload,
            raw,
            call,
            headers,
            scope["headers"],
            receive,
            send,
        )

    async def _ollama_info(
        self,
        path: str,
        method: str,
        authorization: bytes | None,
        surface: Surface,
        headers: Headers,
        receive: Receive,
        send: Send,
    ) -> None:
        """Ollama's own endpoints besides inference: its banner, version and
        model catalogue (of the whole fleet), answered without a backend."""
        allowed = OLLAMA_INFO_PATHS.get(path, ("POST",))
        if method not in allowed and not (method == "HEAD" and "GET" in allowed):
            raise method_not_allowed(method, path)
        if path in OLLAMA_UNSUPPORTED_PATHS:
            raise ProxyError(
                501,
                f"Nexus is a gateway and does not manage models: {path} is not "
                "supported. Pull, create and delete models on the backends.",
                code="not_implemented",
            )
        if path == "/":
            body = b"" if method == "HEAD" else b"Ollama is running"
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", b"17"),
                        *headers,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        if path == "/api/version":
            await _send_json(send, 200, OLLAMA_VERSION, headers)
            return
        state = await self._gateway_state()
        key_prefix = self._authenticate(state, authorization, surface)
        policy = state.policies.get(key_prefix) if key_prefix else None
        if policy is not None and policy.expires_at is not None:
            limits.check_expiry(policy, time.time(), self.gateway.metrics)
        catalog = self.ollama_catalog
        if path == "/api/tags":
            await _send_json(send, 200, catalog.tags(state.routes, policy), headers)
        elif path == "/api/ps":
            await _send_json(send, 200, catalog.ps(state.routes, policy), headers)
        else:
            payload = _parse_object(
                await _read_body(receive, self.max_body, self.body_timeout)
            )
            model = payload.get("model") or payload.get("name")
            if not isinstance(model, str) or not model:
                raise bad_request("model is required", param="model")
            shown = catalog.show(state.routes, model, policy)
            if shown is None:
                raise ProxyError(
                    404, f"model '{model}' not found", code="model_not_found"
                )
            await _send_json(send, 200, shown, headers)

    async def _count_tokens(
        self,
        state: GatewayState,
        policy: KeyPolicy | None,
        headers: Headers,
        receive: Receive,
        send: Send,
    ) -> None:
        """Anthropic's count_tokens, estimated (characters / 4; see the README)."""
        raw = await _read_body(receive, self.max_body, self.body_timeout)
        payload = _parse_object(raw, loads)
        # count_tokens takes a Messages request without max_tokens.
        payload.setdefault("max_tokens", 1)
        inbound = ANTHROPIC.to_canonical(payload)
        try:
            requirements = RequestRequirements.from_request(inbound.canonical)
        except RoutingError as error:
            raise _routing_error(error) from error
        gateway = self.gateway
        if policy is not None:
            limits.check_model(
                policy, state.routes, requirements.model, gateway.metrics
            )
        decision = gateway.router.explain(requirements, state.routes, gateway.stats)
        if decision.error is not None:
            raise _routing_error(decision.error)
        tokens = anthropic_translate.estimate_input_tokens(inbound.canonical)
        body = json.dumps({"input_tokens": tokens}).encode()
        await _send_json(send, 200, body, headers)

    async def _route_and_forward(
        self,
        state: GatewayState,
        exchange: Exchange,
        requirements: RequestRequirements,
        key_prefix: str,
        payload: dict[str, Any],
        raw: bytes,
        call: Call | None,
        headers: Headers,
        request_headers: Headers,
        receive: Receive,
        send: Send,
    ) -> None:
        try:
            await self._forward_watching_client(
                state,
                exchange,
                requirements,
                key_prefix,
                payload,
                raw,
                call,
                headers,
                request_headers,
                receive,
                send,
            )
        except ProxyError as error:
            exchange.status = error.status
            exchange.error = error.code or error.error_type
            error.recorded = True
            raise
        finally:
            self._record(exchange, state, key_prefix, requirements.estimated_tokens)

    async def _forward_watching_client(
        self,
        state: GatewayState,
        exchange: Exchange,
        requirements: RequestRequirements,
        key_prefix: str,
        payload: dict[str, Any],
        raw: bytes,
        call: Call | None,
        headers: Headers,
        request_headers: Headers,
        receive: Receive,
        send: Send,
    ) -> None:
        """Check the key, wait for admission, route and forward; a client that
        hangs up cancels.

        Every surface comes through here: the key's allow-list, rate limits,
        concurrency and budget are checked first (a refusal costs no place in
        a queue), then admission control. The key's ticket is settled by
        ``_record``; the admission ticket is released in every outcome
        (answer, error, retries, a stream cut short, the client gone while
        waiting or while served), which is what brings the stock back to 0.
        """
        gateway = self.gateway
        policy = state.policies.get(key_prefix) if key_prefix else None
        if policy is not None:
            await self._check_key(
                state, policy, exchange, requirements, call, payload, headers
            )
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(
            _cancel_on_disconnect(receive, task, exchange)
        )
        ticket = None
        try:
            try:
                ticket = gateway.admission.prepare(
                    state, requirements, payload, key_prefix, request_headers
                )
                if ticket is not None:
                    await gateway.admission.admit(ticket)
            except BadAdmissionHeader as error:
                raise bad_request(str(error), param=error.header) from None
            except AdmissionError as error:
                raise _admission_error(error, exchange, headers) from None
            route, routes = await self._route(state, requirements)
            fleet = gateway.fleet
            fleet.after_decision(route, routes)
            try:
                placed = await fleet.take_slot(route, routes)
            except FleetRefusal as error:
                raise _fleet_error(error, exchange, headers) from None
            await forward(gateway, exchange, placed, payload, raw, send, headers, call)
        except asyncio.CancelledError:
            if not exchange.client_gone:
                raise
            task.uncancel()
            exchange.status = CLIENT_CLOSED
            exchange.error = "client_closed"
            if ticket is not None and ticket.outcome is None:
                exchange.usage = _NOTHING_BILLED  # left while queued
        finally:
            watcher.cancel()
            gateway.admission.release(ticket)

    async def _route(
        self, state: GatewayState, requirements: RequestRequirements
    ) -> tuple[Route, RouterSnapshot]:
        """Route the request, holding it first when its model has no backend.

        With the policy's hold_seconds > 0, a request whose model exists but
        has no backend able to take it now waits for one (gateway/fleet); when
        the time is up it goes down the fallback chain through the full
        pipeline, and is refused if that finds nothing either. Relay workers
        are backends like any other here: requests for busy ones wait in
        admission's queue (before this) or the fleet's lines (after it).
        """
        gateway = self.gateway
        router, stats, fleet = gateway.router, gateway.stats, gateway.fleet
        routes = state.routes
        try:
            route = router.select(requirements, routes, stats)
        except RoutingError as error:
            if not fleet.should_hold(error.decision, routes):
                raise _routing_error(error) from error
        else:
            if not fleet.should_hold(route.decision, routes):
                return route, routes

        def route_primary(now: RouterSnapshot) -> tuple[Route, RouterSnapshot] | None:
            try:
                found = router.select(requirements, now, stats)
            except RoutingError:
                return None
            return None if found.decision.via == Via.FALLBACK else (found, now)

        held = await fleet.hold(route_primary)
        if held is not None:
            return held
        latest = gateway.snapshots.peek()
        routes = routes if latest is None else latest.routes
        try:
            return router.select(requirements, routes, stats), routes
        except RoutingError as error:
            raise _routing_error(error) from error

    async def _check_key(
        self,
        state: GatewayState,
        policy: KeyPolicy,
        exchange: Exchange,
        requirements: RequestRequirements,
        call: Call | None,
        payload: dict[str, Any],
        headers: Headers,
    ) -> None:
        """Refuse what the key may not do, or take its share of its limits.

        The rate-limit headers go onto `headers` (the answer's, or the
        refusal's); a budgeted stream gets a meter that may cut it short.
        """
        gateway = self.gateway
        metrics = gateway.metrics
        model = requirements.model
        limits.check_model(policy, state.routes, model, metrics)
        if not policy.is_limited:
            return
        prompt = requirements.estimated_tokens
        if call is None:
            canonical, endpoint = payload, exchange.endpoint
        else:
            canonical = call.inbound.canonical
            endpoint = call.inbound.canonical_endpoint
        completion = limits.completion_estimate(
            canonical, endpoint == "embeddings", self.default_completion
        )
        price = limits.price_estimate(state.prices, state.routes, model)
        ticket = await limits.admit(
            gateway.limiter,
            policy,
            prompt + completion,
            price.cost(prompt, completion),
            headers,
            metrics,
        )
        exchange.limit_ticket = ticket
        if exchange.stream and policy.has_budget:
            exchange.meter = limits.BudgetMeter(
                gateway.limiter, ticket, state.prices, model, prompt
            )


def _fleet_error(
    error: FleetRefusal, exchange: Exchange, headers: Headers
) -> ProxyError:
    """The client's answer to a request the fleet queues did not run."""
    exchange.usage = _NOTHING_BILLED
    headers.append((b"retry-after", str(error.retry_after).encode()))
    return ProxyError(503, error.message, error_type="server_error", code=error.code)


def _admission_error(
    error: AdmissionError, exchange: Exchange, headers: Headers
) -> ProxyError:
    """The client's answer to a request admission control did not let through."""
    exchange.usage = _NOTHING_BILLED
    if error.retry_after is not None:
        headers.append((b"retry-after", str(error.retry_after).encode()))
    return ProxyError(
        error.status, error.message, error_type=error.error_type, code=error.code
    )


async def _cancel_on_disconnect(
    receive: Receive, task: asyncio.Task[Any], exchange: Exchange
) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            exchange.client_gone = True
            task.cancel()
            return


async def _read_body(receive: Receive, limit: int, timeout: float) -> bytes:
    """The request's body, cut at `limit` bytes (413) as it arrives, and
    within `timeout` seconds (408: a client dripping it). Daphne hands over a
    body already whole (it enforces both before the application runs)."""
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
                    raise _too_large(limit)
                chunks.append(chunk)
                if not message.get("more_body"):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except TimeoutError:
        raise ProxyError(
            408, "The request body did not arrive in time.", code="request_timeout"
        ) from None


def _too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"The request body is larger than this gateway accepts ({limit} bytes).",
        code="request_too_large",
    )


def _parse_object(
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


def _parse_body(raw: bytes, endpoint: str) -> dict[str, Any]:
    """Decode and check the shape of a request body (400 on anything wrong)."""
    payload = _parse_object(raw)
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


# A count a backend reports is believed up to this (far above any real request).
MAX_REPORTED_TOKENS = 10**12


def _token_count(value: Any) -> int | None:
    """A token count a backend reported, if it is one (clamped into range)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return min(max(value, 0), MAX_REPORTED_TOKENS)


def _unsent_bytes_probe(scope: dict[str, Any]) -> Callable[[], int] | None:
    transport = scope.get("extensions", {}).get("nexus.transport")
    return transport.get("unsent_bytes") if isinstance(transport, dict) else None


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
