"""ASGI entry point: the gateway's /v1 proxy beside Django (Channels).

Any ASGI server runs ``application``: Daphne (the default, also as the Docker
image starts it), uvicorn or granian (``nexus_run --server``).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nexus_site.settings")

# Set up Django (apps, settings) before anything imports models: the gateway,
# consumers and the proxy are imported below this line for that reason.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter
from django.conf import settings
from django.urls import re_path

from gateway.process import Gateway, install_gateway
from gateway.proxy import OLLAMA_PATHS, ProxyApp, is_ollama_blob
from gateway.proxy.surfaces import near_miss
from gateway.relay.consumer import WorkerConsumer
from nexus_site.roles import NotServedHere, RelayElsewhere
from nexus_site.servers import serving
from usage.consumers import UsageStreamConsumer

Scope = dict[str, Any]

_JSON = (b"content-type", b"application/json")
_LIVE = b'{"status":"live"}'
_READY = b'{"status":"ready"}'
_DRAINING = b'{"status":"draining"}'


class NexusApplication:
    """Send /v1 and Ollama's paths (``/``, ``/api/chat``, ...; Nexus's own API
    is under ``/api/v1/``, which Ollama does not use) to the proxy, /metrics and
    /health/* to the gateway, the rest to Django; run the gateway's background
    tasks.

    The gateway's paths are dispatched here with string comparisons rather than
    through a URL router or middleware, because /v1 is the hot path. Daphne
    sends no lifespan events, so the gateway also starts with the first request
    (a cheap check on every later one) or, under Daphne, as soon as its
    reactor runs; servers that send them (uvicorn, granian) start it before the
    first request and stop it at exit.
    """

    def __init__(self, gateway: Gateway, proxy: Any, django: Any) -> None:
        self.gateway = gateway
        self.proxy = proxy
        self.django = django

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if (
                path.startswith("/v1/")
                or path == "/v1"
                or path in OLLAMA_PATHS
                or is_ollama_blob(path)
            ):
                await self.proxy(scope, receive, send)
                return
            if near_miss(path) is not None:
                await self.proxy(scope, receive, send)  # a 404 naming the path
                return
            self.gateway.ensure_started()
            if path == "/metrics":
                await self.gateway.metrics_endpoint(scope, receive, send)
                return
            if path == "/health/live":
                await _send(send, 200, _LIVE)
                return
            if path == "/health/ready":
                ready = not self.gateway.draining
                await _send(send, 200 if ready else 503, _READY if ready else _DRAINING)
                return
            # Django spools any body (to disk past 2.5 MB) without a size or a
            # deadline; Daphne bounds both before the application runs, the
            # other servers hand the head over first.
            body = _BoundedBody(
                receive,
                send,
                self.gateway.config.max_body_bytes,
                self.gateway.config.client_body_timeout,
            )
            await self.django(scope, body.receive, body.send)
            return
        elif kind == "lifespan":
            await self._lifespan(receive, send)
            return
        else:
            self.gateway.ensure_started()
        await self.django(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.gateway.ensure_started()
                serving.tune_process()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.gateway.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


class _BoundedBody:
    """A request body for Django, cut at `limit` bytes (413) and `timeout`
    seconds (408): the answer is sent here and Django sees a disconnect."""

    __slots__ = ("_deadline", "_limit", "_receive", "_received", "_refused", "_send")

    def __init__(self, receive: Any, send: Any, limit: int, timeout: float) -> None:
        self._receive = receive
        self._send = send
        self._limit = limit
        self._deadline: float | None = asyncio.get_running_loop().time() + timeout
        self._received = 0
        self._refused = False

    async def receive(self) -> dict[str, Any]:
        if self._refused:
            return {"type": "http.disconnect"}
        if self._deadline is None:  # the body is whole: pass on (disconnects)
            message: dict[str, Any] = await self._receive()
            return message
        try:
            async with asyncio.timeout_at(self._deadline):
                message = await self._receive()
        except TimeoutError:
            return await self._refuse(408, "The request body did not arrive in time.")
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._limit:
                return await self._refuse(
                    413,
                    "The request body is larger than this gateway accepts "
                    f"({self._limit} bytes).",
                )
            if not message.get("more_body"):
                self._deadline = None
        return message

    async def send(self, message: dict[str, Any]) -> None:
        if not self._refused:
            await self._send(message)

    async def _refuse(self, status: int, text: str) -> dict[str, Any]:
        self._refused = True
        code = "request_timeout" if status == 408 else "request_too_large"
        body = json.dumps(
            {
                "error": {
                    "message": text,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": code,
                }
            }
        ).encode()
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                # No "connection: close": the server would reset the
                # connection with the client's bytes unread, and the client
                # could lose this answer; it reads the rest and discards it.
                "headers": [_JSON, (b"content-length", str(len(body)).encode())],
            }
        )
        await self._send({"type": "http.response.body", "body": body})
        return {"type": "http.disconnect"}


def _with_session(app: Any) -> Any:
    """`app` with the user of the session cookie (imported only where needed:
    a gateway-only process loads no session machinery)."""
    from channels.auth import AuthMiddlewareStack

    return AuthMiddlewareStack(app)


async def _send(send: Any, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                _JSON,
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


gateway = Gateway()
install_gateway(gateway)
# A process that exits without the gateway's stop() (a server sending no
# lifespan events, stopped by a signal) still hands its usage on.
atexit.register(gateway.usage_sink.flush_on_exit)

# NEXUS_ROLE (docs/kubernetes.md): a gateway-only process serves no usage
# stream (the dashboard's, a control page); a control-only process serves no
# model requests and no relay WebSocket: relayed requests are model traffic,
# which belongs with the gateway processes that forward it.
role = settings.NEXUS_ROLE
http_routes = URLRouter(
    [
        # The usage stream needs the session (staff login) from the cookie.
        # With or without a trailing slash, as every path of the API.
        *(
            []
            if role == "gateway"
            else [
                re_path(
                    r"^api/usage-stream/?$",
                    _with_session(
                        UsageStreamConsumer.as_asgi(publisher=gateway.publisher)
                    ),
                )
            ]
        ),
        # Everything else is Django's. URLRouter takes ASGI apps; django-stubs
        # types re_path() for views only.
        re_path(r"", django_asgi_app),  # type: ignore[arg-type]
    ]
)
# Relay workers behind NAT dial in here (see gateway/relay/consumer.py).
websocket_routes = URLRouter(
    [
        re_path(
            r"^ws/workers/?$",
            RelayElsewhere()  # type: ignore[arg-type]
            if role == "control"
            else WorkerConsumer.as_asgi(hub=gateway.relay, guard=gateway.relay_guard),
        )
    ]
)
proxy = ProxyApp(gateway)
application = NexusApplication(
    gateway,
    NotServedHere() if role == "control" else proxy,
    ProtocolTypeRouter({"http": http_routes, "websocket": websocket_routes}),
)
serving.prepare_daphne(gateway, proxy)
