"""The gateway's client API: a plain ASGI app on the hot path.

It answers every inbound surface (gateway/proxy/surfaces.py): OpenAI's and
Anthropic's under /v1, and Ollama's native API at the root (``/``,
``/api/version``, ``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/chat``,
``/api/generate``, ``/api/embed``, ``/api/embeddings``, and model management,
passed to one Ollama backend: gateway/proxy/model_management.py).

``ProxyApp`` dispatches: by path and method to the surface, through the key
check, to what answers without a backend (model lists, Ollama's catalogue,
count_tokens) or, once the body is read and made canonical, to the pipeline
(gateway/proxy/pipeline.py). Nothing here touches the ORM, blocks, or builds
an HTTP client per request: it reads the gateway's immutable state
(routing/state.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from typing import TYPE_CHECKING, Any

from gateway.exchange import Exchange, Headers
from gateway.protocols import anthropic as anthropic_translate
from gateway.protocols.base import loads
from gateway.proxy import limits, traces
from gateway.proxy.accounting import Accounting
from gateway.proxy.bodies import (
    ClientGone,
    Receive,
    parse_body,
    parse_object,
    read_body,
    too_large,
)
from gateway.proxy.ensemble import base_requirements
from gateway.proxy.errors import (
    ProxyError,
    bad_request,
    method_not_allowed,
    not_found,
    routing_error,
    unauthorized,
)
from gateway.proxy.forward import Upstream
from gateway.proxy.legs import Call, ProxyExchange
from gateway.proxy.model_blobs import ModelBlobs
from gateway.proxy.model_management import ModelManagement
from gateway.proxy.models_list import ModelsList
from gateway.proxy.ollama_catalog import OllamaCatalog
from gateway.proxy.pipeline import Pipeline
from gateway.proxy.relays import Send
from gateway.proxy.surfaces import (
    ANTHROPIC,
    COUNT_TOKENS_PATH,
    ENDPOINTS,
    OLLAMA_INFO_PATHS,
    OLLAMA_MANAGEMENT_PATHS,
    OLLAMA_VERSION,
    OPENAI,
    Surface,
    is_ollama_blob,
    near_miss,
)
from routing.core import RequestRequirements, RoutingError
from routing.state import GatewayState
from usage.buffer import new_event_id

if TYPE_CHECKING:
    from gateway.process import Gateway

logger = logging.getLogger(__name__)

MODELS_PATH = "/v1/models"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_NO_ENDPOINT: tuple[str | None, Surface] = (None, OPENAI)
_OLLAMA = ENDPOINTS["/api/chat"][1]  # Ollama's error shape


class ProxyApp:
    """ASGI application for every path under /v1, serving with one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        config = gateway.config
        self.max_body = config.max_body_bytes
        self.body_timeout = config.client_body_timeout
        self.auth_required = config.auth_required
        self.models = ModelsList()
        self.ollama_catalog = OllamaCatalog()
        self.accounting = Accounting(
            gateway.limiter,
            gateway.metrics,
            gateway.buffer,
            gateway.live_usage,
            config.access_log,
            gateway.open_requests,
            gateway.stats,
        )
        upstream = Upstream(
            client=gateway.upstream,
            stats=gateway.stats,
            breaker=gateway.breaker,
            error_cache=gateway.error_cache,
            limiter=gateway.limiter,
            relay=gateway.relay,
            fleet=gateway.fleet,
            metrics=gateway.metrics,
            live_usage=gateway.live_usage,
            context_limits=gateway.context_limits,
        )
        self.pipeline = Pipeline(gateway, upstream, self.accounting)
        self.management = ModelManagement(gateway)
        self.blobs = ModelBlobs(gateway)

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
        path, method = scope["path"], scope["method"]
        endpoint, surface = _endpoint_of(path, anthropic_client)
        rid = _request_id(request_id)
        exchange: ProxyExchange = Exchange(
            request_id=rid,
            endpoint=endpoint,
            path=path,
            request_headers=scope["headers"],
            response_headers=[(b"x-request-id", rid.encode())],
            unsent_bytes=_transport_hook(scope, "unsent_bytes"),
            abort=_transport_hook(scope, "abort"),
        )
        tracing = self.gateway.tracing
        if tracing is not None:
            traces.start(tracing, exchange, method)
        try:
            if path in OLLAMA_MANAGEMENT_PATHS or is_ollama_blob(path):
                state = exchange.state = await self._gateway_state()
                self._identify(exchange, state, authorization, surface)
                query = scope.get("query_string", b"")
                if path in OLLAMA_MANAGEMENT_PATHS:
                    await self.management.serve(
                        exchange, state, method, query, receive, send
                    )
                else:
                    await self.blobs.serve(exchange, state, scope, receive, send)
                return
            if path in OLLAMA_INFO_PATHS:
                await self._ollama_info(
                    exchange, method, authorization, surface, receive, send
                )
                return
            self._check_request_line(exchange, method)
            state = exchange.state = await self._gateway_state()
            if api_key is not None and surface.accepts_x_api_key:
                authorization = b"Bearer " + api_key
            self._identify(exchange, state, authorization, surface)
            if endpoint:
                self._check_length(content_length)
            await self._answer(exchange, state, surface, scope, receive, send)
        except ProxyError as error:
            if endpoint and endpoint != "count_tokens" and not error.recorded:
                # Refused before any backend (401, 413, a body that does not
                # parse, draining): a request and an error all the same.
                self.accounting.refuse(exchange, error)
            if exchange.trace is not None:
                traces.refused(exchange, error)
            body = surface.error_body(error)
            await _send_json(send, error.status, body, exchange.response_headers)
        except ClientGone:
            pass
        finally:
            if exchange.trace is not None:
                traces.finish(exchange)

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
            refused: ProxyExchange = Exchange(
                request_id=rid,
                endpoint=endpoint,
                path=path,
                state=self.gateway.snapshots.peek(),
            )
            self.accounting.refuse(refused, error)
        return rid

    def _check_request_line(self, exchange: ProxyExchange, method: str) -> None:
        """Refuse an unknown path, the wrong method, or any request while draining."""
        endpoint, path = exchange.endpoint, exchange.path
        if (
            not endpoint
            and path != MODELS_PATH
            and not path.startswith(MODELS_PATH + "/")
        ):
            meant = near_miss(path)
            raise not_found(path, hint=f" Did you mean {meant}?" if meant else "")
        allowed = "POST" if endpoint else "GET"
        if method != allowed:
            raise method_not_allowed(method, path)
        if self.gateway.draining:
            exchange.response_headers += (
                (b"connection", b"close"),
                (b"retry-after", b"1"),
            )
            raise ProxyError(
                503,
                "This Nexus server is shutting down; retry the request.",
                error_type="server_error",
                code="shutting_down",
            )

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

    def _identify(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        authorization: bytes | None,
        surface: Surface,
    ) -> None:
        """Note the client's key and its policy on the exchange (401, expired: 403)."""
        key_prefix = exchange.key_prefix = self._authenticate(
            state, authorization, surface
        )
        policy = exchange.policy = (
            state.policies.get(key_prefix) if key_prefix else None
        )
        if policy is not None and policy.expires_at is not None:
            limits.check_expiry(policy, time.time(), self.gateway.metrics)

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
            raise too_large(self.max_body)

    async def _answer(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        surface: Surface,
        scope: dict[str, Any],
        receive: Receive,
        send: Send,
    ) -> None:
        """Answer a request that passed the key check: by its endpoint."""
        endpoint = exchange.endpoint
        if endpoint == "count_tokens":
            await self._count_tokens(exchange, state, receive, send)
        elif endpoint:
            raw = await read_body(receive, self.max_body, self.body_timeout)
            requirements = (
                _read_openai(exchange, raw)
                if surface is OPENAI
                else await self._read_translated(exchange, state, surface, raw, send)
            )
            if requirements is None:
                return  # answered without a backend
            exchange.started = time.perf_counter()
            if exchange.trace is not None:
                traces.note_request(exchange)
            if state.routes.policy.cache.enabled and await self._answer_cached(
                exchange, state, surface, requirements, send
            ):
                return
            await self.pipeline.serve(exchange, state, requirements, receive, send)
        else:
            query = scope.get("query_string", b"")
            await self._models(exchange, state, surface, query, send)

    async def _answer_cached(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        surface: Surface,
        requirements: RequestRequirements,
        send: Send,
    ) -> bool:
        """Answer from the response cache if it has the answer (recorded)."""
        cached = self.pipeline.cached
        trace = exchange.trace
        span = None if trace is None else trace.child("cache lookup")
        entry = await cached.look_up(exchange, state, requirements)
        if trace is not None:
            traces.end_cache_lookup(exchange, trace, span, entry is not None)
        if entry is None:
            return False
        try:
            await cached.serve_hit(exchange, entry, send)
        finally:
            self.accounting.record(exchange)
        return True

    async def _read_translated(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        surface: Surface,
        raw: bytes,
        send: Send,
    ) -> RequestRequirements | None:
        """Make a request on a surface other than OpenAI's canonical to route it.

        Returns its requirements, or None once answered here: nothing for a
        backend to do (Ollama's "load the model"), answered once some backend
        could serve the model (and the key may).
        """
        payload = parse_object(raw, loads)
        inbound = surface.to_canonical(payload)
        requirements = _requirements_of(inbound.canonical)
        if inbound.ready is not None:
            gateway = self.gateway
            if exchange.policy is not None:
                limits.check_model(
                    exchange.policy, state.routes, requirements.model, gateway.metrics
                )
            decision = gateway.router.explain(
                base_requirements(state.routes, requirements),
                state.routes,
                gateway.stats,
            )
            if decision.error is not None:
                raise routing_error(decision.error)
            await _send_json(send, 200, inbound.ready, exchange.response_headers)
            return None
        client_headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in exchange.request_headers
            if name.startswith(b"anthropic-")
        }
        exchange.call = Call(surface, inbound, payload, raw, client_headers)
        exchange.payload, exchange.raw = payload, raw
        exchange.requested_model, exchange.stream = requirements.model, inbound.stream
        exchange.requirements = requirements
        return requirements

    async def _models(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        surface: Surface,
        query: bytes,
        send: Send,
    ) -> None:
        """List the models the key may use, or show one (OpenAI's or Anthropic's)."""
        policy, headers = exchange.policy, exchange.response_headers
        if exchange.path == MODELS_PATH:
            if surface is ANTHROPIC:
                body = self.models.anthropic_page(state.routes, policy, query)
            else:
                body = self.models.body(state.routes, policy)
            await _send_json(send, 200, body, headers)
            return
        model_id = exchange.path[len(MODELS_PATH) + 1 :]
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

    async def _ollama_info(
        self,
        exchange: ProxyExchange,
        method: str,
        authorization: bytes | None,
        surface: Surface,
        receive: Receive,
        send: Send,
    ) -> None:
        """Ollama's own endpoints besides inference: its banner, version and
        model catalogue (of the whole fleet), answered without a backend."""
        path, headers = exchange.path, exchange.response_headers
        allowed = OLLAMA_INFO_PATHS.get(path, ())
        if method not in allowed and not (method == "HEAD" and "GET" in allowed):
            raise method_not_allowed(method, path)
        if path == "/":
            body = b"" if method == "HEAD" else b"Ollama is running"
            await _send_banner(send, body, headers)
            return
        if path == "/api/version":
            await _send_json(send, 200, OLLAMA_VERSION, headers)
            return
        state = exchange.state = await self._gateway_state()
        self._identify(exchange, state, authorization, surface)
        policy = exchange.policy
        catalog = self.ollama_catalog
        if path == "/api/tags":
            await _send_json(send, 200, catalog.tags(state.routes, policy), headers)
        elif path == "/api/ps":
            await _send_json(send, 200, catalog.ps(state.routes, policy), headers)
        else:
            payload = parse_object(
                await read_body(receive, self.max_body, self.body_timeout)
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
        exchange: ProxyExchange,
        state: GatewayState,
        receive: Receive,
        send: Send,
    ) -> None:
        """Anthropic's count_tokens, estimated (characters / 4; see docs/surfaces.md)."""
        raw = await read_body(receive, self.max_body, self.body_timeout)
        payload = parse_object(raw, loads)
        # count_tokens takes a Messages request without max_tokens.
        payload.setdefault("max_tokens", 1)
        inbound = ANTHROPIC.to_canonical(payload)
        requirements = _requirements_of(inbound.canonical)
        gateway = self.gateway
        if exchange.policy is not None:
            limits.check_model(
                exchange.policy, state.routes, requirements.model, gateway.metrics
            )
        decision = gateway.router.explain(
            base_requirements(state.routes, requirements), state.routes, gateway.stats
        )
        if decision.error is not None:
            raise routing_error(decision.error)
        tokens = anthropic_translate.estimate_input_tokens(inbound.canonical)
        body = json.dumps({"input_tokens": tokens}).encode()
        await _send_json(send, 200, body, exchange.response_headers)


def _endpoint_of(path: str, anthropic_client: bool) -> tuple[str, Surface]:
    """Return the path's endpoint ("" for none) and the surface that answers it."""
    if path == COUNT_TOKENS_PATH:
        return "count_tokens", ANTHROPIC
    endpoint, surface = ENDPOINTS.get(path, _NO_ENDPOINT)
    if endpoint is None and (meant := near_miss(path)) is not None:
        # Not served under this spelling; refused in the shape of the path meant.
        return "", _endpoint_of(meant, anthropic_client)[1]
    if (
        path in OLLAMA_INFO_PATHS
        or path in OLLAMA_MANAGEMENT_PATHS
        or is_ollama_blob(path)
    ):
        surface = _OLLAMA
    elif anthropic_client and endpoint is None:
        # Anthropic's SDK lists models at the same path (its Models API):
        # its key header, its shapes and its error shape.
        surface = ANTHROPIC
    return endpoint or "", surface


def _read_openai(exchange: ProxyExchange, raw: bytes) -> RequestRequirements:
    """Parse and check an OpenAI request's body onto the exchange."""
    payload = parse_body(raw, exchange.endpoint)
    requirements = _requirements_of(payload)
    exchange.payload, exchange.raw = payload, raw
    exchange.requested_model = requirements.model
    exchange.stream = payload.get("stream") is True
    exchange.requirements = requirements
    return requirements


def _requirements_of(canonical: dict[str, Any]) -> RequestRequirements:
    try:
        return RequestRequirements.from_request(canonical)
    except RoutingError as error:
        raise routing_error(error) from error


def _transport_hook(scope: dict[str, Any], name: str) -> Any:
    """A hook of the server's connection (nexus_site.servers.daphne_limits)."""
    transport = scope.get("extensions", {}).get("nexus.transport")
    return transport.get(name) if isinstance(transport, dict) else None


def _request_id(value: bytes | None) -> str:
    if value:
        text = value.decode("latin-1")
        if _REQUEST_ID.fullmatch(text):
            return text
    return new_event_id()


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


async def _send_banner(send: Send, body: bytes, headers: Headers) -> None:
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
