"""``GET /metrics``: who may read the gateway's metrics, and the ASGI answer.

A scrape is allowed from the networks in NEXUS_METRICS_ALLOW, or anywhere with
the bearer token NEXUS_METRICS_TOKEN. Before answering, the endpoint refreshes
the gauges from the gateway's state, then renders the text off the event loop
(in multiprocess mode that reads every sibling's files).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from gateway.metrics.registry import GatewayMetrics

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Send = Callable[[dict[str, Any]], Awaitable[None]]


def parse_networks(values: Iterable[str | Network]) -> tuple[Network, ...]:
    """Parse CIDR strings or networks (a bad one raises ValueError)."""
    return tuple(
        ipaddress.ip_network(str(value).strip(), strict=False) for value in values
    )


class MetricsEndpoint:
    """``GET /metrics`` for the networks (or the bearer token) allowed to read it."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        refresh: Callable[[], None],
        allow: tuple[Network, ...],
        token: str = "",
    ) -> None:
        self.metrics = metrics
        self.refresh = refresh
        self.allow = allow
        self.token = token.encode()

    def is_allowed(self, scope: dict[str, Any]) -> bool:
        if self.token:
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    scheme, _, given = value.partition(b" ")
                    if scheme.lower() == b"bearer" and hmac.compare_digest(
                        given.strip(), self.token
                    ):
                        return True
        client = scope.get("client")
        if not client:
            return False
        try:
            address = ipaddress.ip_address(client[0])
        except ValueError:
            return False
        return any(address in network for network in self.allow)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["method"] not in ("GET", "HEAD"):
            await _send_text(send, 405, b"Use GET.\n", (b"allow", b"GET"))
            return
        if not self.is_allowed(scope):
            await _send_text(
                send,
                403,
                b"Metrics are readable from the networks in NEXUS_METRICS_ALLOW, "
                b"or with 'Authorization: Bearer <NEXUS_METRICS_TOKEN>'.\n",
            )
            return
        self.refresh()
        body = await asyncio.to_thread(self.metrics.render)
        await _send_text(send, 200, body, content_type=CONTENT_TYPE_LATEST.encode())


async def _send_text(
    send: Send,
    status: int,
    body: bytes,
    *extra: tuple[bytes, bytes],
    content_type: bytes = b"text/plain; charset=utf-8",
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
