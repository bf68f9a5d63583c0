"""The live usage stream: Server-Sent Events for the dashboard and for scripts.

``GET /api/usage-stream`` (a staff session, or ``Authorization: Token <admin
token>``) answers ``text/event-stream``: first an ``event: snapshot`` with the
merged counters of every process this one hears of (see usage/publisher.py:
the whole cluster with the Redis channel layer, this process alone with the
embedded in-memory layer) plus backend health, then an ``event: update`` with
the same shape whenever any process's counters change, at most
``MAX_UPDATES_PER_SECOND`` times a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, NoReturn, TypedDict

from channels.db import database_sync_to_async
from channels.exceptions import StopConsumer
from channels.generic.http import AsyncHttpConsumer
from rest_framework.authtoken.models import Token

from backends.health import BackendHealthDict, read_backend_health
from usage.access import may_see_dashboard
from usage.live import AdmissionLiveDict, SeriesDict, SlotDict
from usage.publisher import (
    ClusterUsageDict,
    ModelLatencyDict,
    Subscription,
    UsagePublisher,
)

logger = logging.getLogger(__name__)

MAX_UPDATES_PER_SECOND = 4
HEALTH_REFRESH_SECONDS = 5.0


class BackendLoadDict(BackendHealthDict):
    """A backend's recorded health and its requests in flight right now."""

    in_flight: int


class UsageStreamEventDict(TypedDict):
    """The payload of every ``snapshot`` and ``update`` event."""

    taken_at: float
    processes: list[str]
    subscribers: int  # usage streams open on the serving process
    series: list[SeriesDict]
    latency: list[ModelLatencyDict]
    backends: list[BackendLoadDict]
    slot_seconds: int
    recent: list[SlotDict]  # finished requests per time slot, last minutes
    admission: AdmissionLiveDict | None  # None: no serving process reports one


def _token_refusal(raw: str) -> int:
    """0 for an admin token; 401 for an unknown one, 403 for a non-staff user's."""
    token = Token.objects.select_related("user").filter(key=raw).first()
    if token is None or not token.user.is_active:
        return 401
    return 0 if may_see_dashboard(token.user) else 403


def build_stream_event(
    usage: ClusterUsageDict, health: list[BackendHealthDict], subscribers: int
) -> UsageStreamEventDict:
    """Combine merged counters and backend health into one stream event."""
    in_flight: dict[str, int] = {}
    for row in usage["series"]:
        in_flight[row["backend"]] = in_flight.get(row["backend"], 0) + row["in_flight"]
    backends: list[BackendLoadDict] = [
        {**backend, "in_flight": in_flight.get(backend["name"], 0)}
        for backend in health
    ]
    return {
        "taken_at": usage["taken_at"],
        "processes": usage["processes"],
        "subscribers": subscribers,
        "series": usage["series"],
        "latency": usage["latency"],
        "backends": backends,
        "slot_seconds": usage["slot_seconds"],
        "recent": usage["recent"],
        "admission": usage["admission"],
    }


class UsageStreamConsumer(AsyncHttpConsumer):
    """Stream live usage to one staff client until it disconnects.

    The ASGI wiring passes the serving process's publisher:
    ``UsageStreamConsumer.as_asgi(publisher=gateway.publisher)``.
    """

    publisher: UsagePublisher | None = None
    subscription: Subscription | None = None
    writer: asyncio.Task[None] | None = None

    def __init__(self, *args: Any, publisher: UsagePublisher | None = None) -> None:
        super().__init__(*args)
        self.publisher = publisher

    async def http_request(self, message: dict[str, Any]) -> None:
        # The base class ends the consumer as soon as handle() returns; a stream
        # must stay open, and keep receiving http.disconnect, so handle() starts
        # a writer task and returns instead of looping.
        if message.get("more_body"):
            return
        await self.handle(b"")

    async def handle(self, body: bytes) -> None:
        if self.scope.get("method") != "GET":
            await self._refuse(405, "Use GET.", ((b"allow", b"GET"),))
        refusal = await self._refusal()
        if refusal:
            # As the management API answers: 401 (and the scheme to use)
            # without valid credentials, 403 for a user who is not staff.
            await self._refuse(
                refusal,
                "Log in as staff, or send 'Authorization: Token <admin token>'.",
                ((b"www-authenticate", b"Token"),) if refusal == 401 else (),
            )
        await self.send_headers(
            headers=[
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
            ]
        )
        self.subscription = self._publisher.subscribe()
        self.writer = asyncio.get_running_loop().create_task(
            self._write(self.subscription), name="usage-stream"
        )

    async def disconnect(self) -> None:
        if self.subscription is not None:
            self._publisher.unsubscribe(self.subscription)
            self.subscription = None
        if self.writer is not None:
            self.writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.writer
            self.writer = None

    @property
    def _publisher(self) -> UsagePublisher:
        if self.publisher is None:
            raise RuntimeError("UsageStreamConsumer.as_asgi() needs a publisher")
        return self.publisher

    async def _refuse(
        self, status: int, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> NoReturn:
        await self.send_response(
            status,
            json.dumps({"detail": detail}).encode(),
            headers=[(b"content-type", b"application/json"), *headers],
        )
        # A refused request is over: end the consumer like the base class does.
        await self.disconnect()
        raise StopConsumer()

    async def _refusal(self) -> int:
        """0 for a staff session or admin token, else the status to refuse with."""
        user = self.scope.get("user")
        if user is not None and user.is_authenticated:
            # Reading the user's roles is a query.
            allowed = await database_sync_to_async(may_see_dashboard)(user)
            return 0 if allowed else 403
        for name, value in self.scope.get("headers", []):
            if name == b"authorization":
                scheme, _, raw = value.decode("latin-1").partition(" ")
                if scheme.lower() == "token" and raw.strip():
                    return await database_sync_to_async(_token_refusal)(raw.strip())
        return 401

    async def _write(self, subscription: Subscription) -> None:
        try:
            await self._write_events(subscription)
        except asyncio.CancelledError:
            raise
        except Exception:
            # End the response: the client's EventSource reconnects, and gets a
            # fresh snapshot, instead of waiting on a stream that went silent.
            logger.exception("The usage stream failed; closing it")
            with contextlib.suppress(Exception):
                await self.send_body(b"", more_body=False)

    async def _write_events(self, subscription: Subscription) -> None:
        loop = asyncio.get_running_loop()
        health = await database_sync_to_async(read_backend_health)()
        health_at = loop.time()
        name = "snapshot"
        while True:
            if loop.time() - health_at > HEALTH_REFRESH_SECONDS:
                health = await database_sync_to_async(read_backend_health)()
                health_at = loop.time()
            publisher = self._publisher
            event = build_stream_event(
                publisher.cluster_state(), health, publisher.subscriber_count
            )
            await self._send_event(name, event)
            name = "update"
            await asyncio.sleep(1 / MAX_UPDATES_PER_SECOND)
            await self._wait_for_change(subscription)

    async def _wait_for_change(self, subscription: Subscription) -> None:
        # Without changes, send again now and then anyway: backend health may
        # have moved, and the traffic shows a quiet stream is still alive.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HEALTH_REFRESH_SECONDS):
                await subscription.wait()

    async def _send_event(self, name: str, event: UsageStreamEventDict) -> None:
        data = json.dumps(event, separators=(",", ":"))
        await self.send_body(
            f"event: {name}\ndata: {data}\n\n".encode(), more_body=True
        )
