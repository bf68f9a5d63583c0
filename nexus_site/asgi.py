"""ASGI entry point: the gateway's /v1 proxy beside Django (Channels)."""

from __future__ import annotations

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nexus_site.settings")

# Set up Django (apps, settings) before anything imports models: the routing
# state, consumers and the proxy are imported below this line for that reason.
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from django.urls import path, re_path

from backends.breaker import breaker
from routing import live
from routing.proxy import ProxyApp
from usage.consumers import UsageStreamConsumer
from usage.flush import flusher
from usage.publisher import publisher

Scope = dict[str, Any]

# Per-process background services: snapshot refresh, circuit-breaker
# announcements, usage flushing, live usage publishing.
BACKGROUND = (live.snapshots, breaker, flusher, publisher)


def _start_background() -> None:
    """Start every background service on the running loop (cheap once started)."""
    for service in BACKGROUND:
        service.ensure_started()


class NexusApplication:
    """Send /v1 to the proxy and everything else to Django; run background tasks.

    The proxy is dispatched here with one string comparison rather than through
    a URL router, because it is the hot path. Daphne sends no lifespan events,
    so the per-process background services start with the first
    request (a cheap check on every later one); servers that do send them
    (uvicorn) start the tasks before the first request and stop them at exit.
    """

    def __init__(self, proxy: Any, django: Any) -> None:
        self.proxy = proxy
        self.django = django

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        _start_background()
        if scope["type"] == "http" and (
            scope["path"].startswith("/v1/") or scope["path"] == "/v1"
        ):
            await self.proxy(scope, receive, send)
        else:
            await self.django(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                _start_background()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for service in BACKGROUND:
                    await service.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


http_routes = URLRouter(
    [
        # The usage stream needs the session (staff login) from the cookie.
        path("api/usage-stream", AuthMiddlewareStack(UsageStreamConsumer.as_asgi())),
        # Everything else is Django's. URLRouter takes ASGI apps; django-stubs
        # types re_path() for views only.
        re_path(r"", django_asgi_app),  # type: ignore[arg-type]
    ]
)
application = NexusApplication(ProxyApp(), ProtocolTypeRouter({"http": http_routes}))
