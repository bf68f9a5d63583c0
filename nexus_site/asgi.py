"""ASGI entry point: Channels' ProtocolTypeRouter in front of Django."""

from __future__ import annotations

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nexus_site.settings")

# Set up Django (apps, settings) before anything imports models: the routing
# state, consumers and the proxy are imported below this line for that reason.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter

from routing import live

Scope = dict[str, Any]


class KeepRoutingCurrent:
    """Start this process's snapshot refresh tasks on its event loop.

    Daphne has no lifespan events, so the tasks start with the first request
    (a cheap check on every later one); servers that send lifespan events
    (uvicorn) start them before the first request and stop them at shutdown.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        live.snapshots.ensure_started()
        await self.app(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                live.snapshots.ensure_started()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await live.snapshots.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


application = KeepRoutingCurrent(ProtocolTypeRouter({"http": django_asgi_app}))
