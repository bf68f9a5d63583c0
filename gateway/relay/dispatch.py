"""Sending a proxied request to a relay worker, wherever its socket lives.

Each serving process has one ``RelayHub`` (owned by the gateway). A worker's
WebSocket is held by one consumer in one process (gateway/relay/consumer.py).
A request for that worker:

* in the same process goes straight to the consumer, and the consumer hands
  the worker's answer straight back (the embedded default: one process);
* in another process goes to the consumer's channel over the Channels layer
  (Redis in production), and the answer comes back, event by event, to this
  process's reply channel, numbered so that a lost or reordered event is
  seen (the stream fails rather than silently missing a piece).

The proxy's ``forward`` (gateway/proxy/forward.py) calls ``RelayHub.open``
where it would call aiohttp, and gets a ``RelayResponse`` that reads like an
``aiohttp.ClientResponse`` (status, headers, ``content.readany()``), so the
checks, SSE relaying, translation for other surfaces and usage accounting are
the very same code for relay backends. Failures are raised as aiohttp's
errors for the same reason.

A worker that dies, or refuses (draining, at capacity), before the first byte
of its answer has the request sent to another worker serving the model, at
most ``MAX_ATTEMPTS`` workers in all; after the first byte the stream ends
with the surface's error event. Closing the response before its end (the
client went away) sends a cancel to the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from channels.layers import get_channel_layer
from multidict import CIMultiDict

from gateway.relay.heartbeats import DEFAULT_HEARTBEATS_PER_SECOND, HeartbeatClock
from gateway.relay.registry import WorkerRegistry
from nexus_lib.service import TaskService
from nexus_worker import protocol
from routing.core import BackendSpec, Health, LiveStats, Target
from routing.state import GatewayState

logger = logging.getLogger(__name__)

RELAY_KIND = "relay"  # backends.models.BackendKind.RELAY
MAX_ATTEMPTS = 3
# Channel-layer event types (consumer <-> requesting process).
REQUEST_EVENT = "relay.request"
CANCEL_EVENT = "relay.cancel"
REFRESH_EVENT = "relay.refresh"  # backends.workers.REFRESH_EVENT
REPLY_EVENT = "relay.reply"
# Every serving process hears each worker's pong load on this group.
LOAD_GROUP = "nexus.relay.load"
LOAD_EVENT = "relay.load"
# Channels of consumers whose worker went away, as heard over LOAD_GROUP before
# this process's snapshot catches up (a request sent there would wait out the
# accept timeout): remembered this long, at most this many.
GONE_SECONDS = 120.0
MAX_GONE = 4096
# Headers the worker passes to its local backend (never the client's auth).
# W3C Trace Context too: the attempt's span reaches the worker's backend
# (gateway/tracing/) when traces are on.
_FORWARDED_HEADERS = ("content-type", "accept", "traceparent", "tracestate")

# A reply event: (kind, payload). Kinds: "accepted" (None: a consumer in
# another process took the request), "chunk" (text), "complete"
# ((status, headers, body)), "error" ((message, code)), "gone" (reason).
ACCEPTED = "accepted"
Event = tuple[str, Any]


class RelayUnavailable(aiohttp.ClientConnectionError):
    """No worker took the request before its first byte (forward retries)."""


class RelayRefused(Exception):
    """No worker could carry this request as it is: the client's to fix.

    ``status`` is the client's answer (400, 413); no worker was asked, and no
    breaker hears of it.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class WorkerLink(Protocol):
    """A consumer holding a worker's socket in this process."""

    def start_request(self, request_id: str, frame: str, reply_to: str) -> None: ...
    def cancel_request(self, request_id: str, reason: str) -> None: ...
    async def leave(self) -> None: ...


@dataclass(slots=True)
class RelayCall:
    """One attempt at one worker, as the requesting process follows it."""

    request_id: str
    channel: str
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    next_seq: int = 0
    finished: bool = False
    # Characters of chunks delivered and not read yet, and their bound (0:
    # none): a worker sending faster than the client reads (its stream held
    # by back-pressure) cannot pile up more than that in this process.
    unread: int = 0
    max_unread: int = 0
    overflowed: bool = False
    on_overflow: Callable[[RelayCall], None] | None = None

    def deliver(self, seq: int | None, event: Event) -> None:
        if self.overflowed:
            return
        if seq is not None:
            if seq != self.next_seq:
                event = ("gone", f"relay event {self.next_seq} lost (got {seq})")
            self.next_seq = seq + 1
        if event[0] == "chunk" and isinstance(event[1], str):
            self.unread += len(event[1])
            if self.max_unread and self.unread > self.max_unread:
                self._overflow()
                return
        self.events.put_nowait(event)

    def _overflow(self) -> None:
        """Drop what the client has not read and end the call at the worker."""
        self.overflowed = True
        while not self.events.empty():
            self.events.get_nowait()
        self.unread = 0
        self.events.put_nowait(
            ("gone", f"reply not read: over {self.max_unread} characters waiting")
        )
        if self.on_overflow is not None:
            self.on_overflow(self)


class _Body:
    """``response.content`` of a RelayResponse: what aiohttp's reader offers."""

    __slots__ = ("_response",)

    def __init__(self, response: RelayResponse) -> None:
        self._response = response

    async def readany(self) -> bytes:
        return await self._response.read_next()

    async def iter_any(self) -> Any:
        while True:
            data = await self._response.read_next()
            if not data:
                return
            yield data


class RelayResponse:
    """A worker's answer, read like an ``aiohttp.ClientResponse``."""

    content_length = None

    def __init__(
        self,
        hub: RelayHub,
        call: RelayCall,
        status: int,
        headers: Mapping[str, str],
        first: list[bytes],
        done: bool,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._hub = hub
        self._call = call
        self.status = status
        self.headers = CIMultiDict(headers)
        self._pending = deque(first)
        self._done = done
        self._on_close = on_close
        self.content = _Body(self)
        # Set when the request was requeued: the backend that served it.
        self.backend_name = ""

    async def read_next(self) -> bytes:
        """The next piece of the body; b"" at its end. Raises on a broken stream."""
        if self._pending:
            return self._pending.popleft()
        if self._done:
            return b""
        kind, payload = await self._call.events.get()
        if kind == "chunk":
            self._call.unread -= len(payload)
            return payload.encode()
        if kind == "complete":
            self._done = True
            _status, _headers, body = payload
            return body.encode() if body else b""
        self._done = True
        message = payload[0] if kind == "error" else payload
        raise aiohttp.ClientPayloadError(f"relay worker: {message}")

    def close(self) -> None:
        """Release the call; cancel it at the worker if it has not ended."""
        call = self._call
        if not call.finished:
            call.finished = True
            self._hub.finish(call, cancel=not self._done)
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


class RelayHub:
    """This process's side of the relay (see the module docstring).

    A service (nexus_lib.service): ``start()`` opens the reply channel,
    ``stop()`` sends the workers away and closes it.
    """

    name = "relay"

    def __init__(
        self,
        accept_timeout: float = 15.0,
        stats: LiveStats | None = None,
        *,
        max_reply: int = 32 * 1024 * 1024,
        max_unread: int = 4 * 1024 * 1024,
        state: Callable[[], GatewayState | None] = lambda: None,
        heartbeats: HeartbeatClock | None = None,
    ) -> None:
        # Consumers holding a worker's socket in this process, by channel name.
        self.links: dict[str, WorkerLink] = {}
        # Consumers here whose worker is registering: the database (and so a
        # snapshot) may name their channel a moment before they attach.
        self._arriving: dict[str, asyncio.Event] = {}
        # Where the workers' pongs go: the router scores by them, here and
        # (over LOAD_GROUP) in every other serving process; requeued requests
        # count in flight there too.
        self.stats = stats if stats is not None else LiveStats()
        # The gateway's current state: its relay backends and the channels of
        # the consumers holding their workers' sockets (read per request).
        self.state = state
        # This process's workers and what their heartbeats report.
        self.registry = WorkerRegistry()
        # What pings them (their consumers join it once registered).
        if heartbeats is None:
            heartbeats = HeartbeatClock(
                protocol.DEFAULT_HEARTBEAT_SECONDS, DEFAULT_HEARTBEATS_PER_SECOND
            )
        self.heartbeats = heartbeats
        # The load last published for each worker connected here.
        self._published: dict[str, int] = {}
        self.max_reply = max_reply  # a whole (non-stream) reply, in bytes
        # A stream's chunks delivered and not read (its client is slow).
        self.max_unread = max_unread
        self._publishing: set[asyncio.Task[None]] = set()
        # Consumer channels known gone (see GONE_SECONDS), oldest first.
        self._gone: dict[str, float] = {}
        self.calls: dict[str, RelayCall] = {}
        self.reply_channel = ""
        self._layer: Any = None
        self._ready = asyncio.Event()
        self._sequence = 0
        # How long a consumer in another process may take to say it took a
        # request (its first event) before the request goes elsewhere.
        self.accept_timeout = accept_timeout
        self._replies = TaskService("relay-replies", self.run)

    # Lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Run the reply channel (``run()``) and the heartbeat clock in tasks
        on the running loop."""
        self._replies.start()
        self.heartbeats.start()

    async def run(self) -> None:
        """Open this process's reply channel and pass on what comes to it.

        Runs in a task of its own (``start()``), for the life of the process.
        """
        self._layer = layer = get_channel_layer()
        if layer is None:
            return
        # The layer's default prefix: channels_redis reads every channel of a
        # process from one list, named by that prefix.
        self.reply_channel = channel = await layer.new_channel()
        self._ready.set()
        while True:
            try:
                message = await layer.receive(channel)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("Relay reply channel failed; retrying", exc_info=True)
                await asyncio.sleep(1.0)
                continue
            call = self.calls.get(message.get("request_id", ""))
            seq = message.get("seq")
            if call is None or not isinstance(seq, int):
                continue
            for offset, event in enumerate(message.get("events") or ()):
                if isinstance(event, list | tuple) and len(event) == 2:
                    call.deliver(seq + offset, (event[0], event[1]))

    async def stop(self) -> None:
        """The process is stopping: its workers are told to reconnect elsewhere.

        Their backends turn Gone at once rather than when their health goes
        stale (a stopping server cancels consumers without their disconnect).
        The reply channel stops after.
        """
        links = list(self.links.values())
        self.links.clear()
        results = await asyncio.gather(
            *(link.leave() for link in links), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("A relay worker did not leave cleanly: %r", result)
        await self.heartbeats.stop()
        await self._replies.stop()

    # The consumer's side -----------------------------------------------------

    def arriving(self, channel: str) -> None:
        """A consumer here is registering its worker: a request for its
        channel waits for it to attach (``attach``, or ``not_arriving``)."""
        self._arriving[channel] = asyncio.Event()

    def not_arriving(self, channel: str) -> None:
        """The registration failed: whoever waits for the channel goes on."""
        event = self._arriving.pop(channel, None)
        if event is not None:
            event.set()

    def attach(self, channel: str, link: WorkerLink) -> None:
        self.links[channel] = link
        self.not_arriving(channel)

    def detach(self, channel: str) -> None:
        self.links.pop(channel, None)

    def report_load(
        self, backend: str, load: int | None, gone_channel: str = ""
    ) -> None:
        """A worker connected here said how many requests it has in flight
        (None: it went away, from its consumer's `gone_channel`); every
        serving process's router hears of it (the others when it changed:
        ``republish_loads`` tells them all now and then)."""
        self._apply_load(backend, load, gone_channel)
        if load is not None and self._published.get(backend) == load:
            return
        if load is None:
            self._published.pop(backend, None)
        else:
            self._published[backend] = load
        message: dict[str, Any] = {"type": LOAD_EVENT, "backend": backend, "load": load}
        if gone_channel:
            message["gone_channel"] = gone_channel
        self._publish(message)

    def republish_loads(self) -> None:
        """Tell every process again the loads of the workers connected here,
        in one message (a process that started since heard only changes)."""
        if self._published:
            loads = [[backend, load] for backend, load in self._published.items()]
            self._publish({"type": LOAD_EVENT, "loads": loads})

    def _publish(self, message: dict[str, Any]) -> None:
        if self._layer is not None:
            task = asyncio.get_running_loop().create_task(self._publish_load(message))
            self._publishing.add(task)
            task.add_done_callback(self._publishing.discard)

    def on_load_message(self, message: dict[str, Any]) -> None:
        """A message of LOAD_GROUP: a worker's load, or (``loads``) several,
        from whichever process holds their sockets (this one's own come back
        too: the same numbers)."""
        backend, load = message.get("backend"), message.get("load")
        gone = message.get("gone_channel")
        if isinstance(backend, str) and (load is None or isinstance(load, int)):
            self._apply_load(backend, load, gone if isinstance(gone, str) else "")
        loads = message.get("loads")
        if isinstance(loads, list):
            for entry in loads[:MAX_GONE]:
                if (
                    isinstance(entry, list)
                    and len(entry) == 2
                    and isinstance(entry[0], str)
                    and isinstance(entry[1], int)
                ):
                    self._apply_load(entry[0], entry[1], "")

    def _apply_load(self, backend: str, load: int | None, gone_channel: str) -> None:
        if load is None:
            self.stats.forget_load(backend)
            if gone_channel:
                self._remember_gone(gone_channel)
        else:
            self.stats.report_load(backend, load)

    def _remember_gone(self, channel: str) -> None:
        now = asyncio.get_running_loop().time()
        gone = self._gone
        gone.pop(channel, None)
        gone[channel] = now
        for old, when in list(gone.items()):
            if len(gone) <= MAX_GONE and now - when < GONE_SECONDS:
                break
            del gone[old]

    def is_gone(self, channel: str) -> bool:
        """Whether `channel`'s consumer is known to have lost its worker (this
        process's snapshot may still list it for a moment)."""
        return channel in self._gone

    async def _publish_load(self, message: dict[str, Any]) -> None:
        try:
            async with asyncio.timeout(5.0):
                await self._layer.group_send(LOAD_GROUP, message)
        except Exception:
            logger.warning("Could not pass on relay workers' load", exc_info=True)

    def deliver(self, request_id: str, event: Event) -> None:
        """Hand an event of a worker's answer to a request of this process."""
        call = self.calls.get(request_id)
        if call is not None:
            call.deliver(None, event)

    async def send_events(
        self, reply_to: str, request_id: str, seq: int, events: list[Event]
    ) -> None:
        """Send events of a worker's answer to the process that asked; the
        first is number `seq`, the others follow it."""
        await self._layer.send(
            reply_to,
            {
                "type": REPLY_EVENT,
                "request_id": request_id,
                "seq": seq,
                "events": [list(event) for event in events],
            },
        )

    # The proxy's side --------------------------------------------------------

    async def open(
        self,
        target: Target,
        request_id: str,
        endpoint: str,
        body: bytes,
        headers: Mapping[str, str],
        stream: bool,
        *,
        method: str = "POST",
        requeue: bool = True,
    ) -> RelayResponse:
        """Send the request to the target's worker; return once it answers.

        Without `requeue`, only the target's worker is asked (Ollama model
        management names the machine it changes).

        A stream returns at its first chunk, a whole reply when complete.
        Raises RelayUnavailable when no worker (of at most MAX_ATTEMPTS)
        answered; aiohttp.ClientPayloadError when a reply is over ``max_reply``;
        RelayRefused when the body cannot go in a frame (not UTF-8, too large).
        """
        state = self.state()
        channels = state.relay_channels if state is not None else {}
        backends = state.routes.backends_by_name if state is not None else {}
        stats, max_reply = self.stats, self.max_reply
        frame_headers = {
            name: headers[name] for name in _FORWARDED_HEADERS if name in headers
        }
        try:
            text = body.decode()
        except UnicodeDecodeError:
            raise RelayRefused(
                400, "The request body is not UTF-8; send JSON as UTF-8."
            ) from None
        tried = [target.backend.name]
        backend_name = target.backend.name
        on_close: Callable[[], None] | None = None
        reasons: list[str] = []
        while True:
            channel = channels.get(backend_name, "")
            if channel and self.is_gone(channel):
                reasons.append(f"{backend_name}: worker gone")
            elif channel:
                self._sequence += 1
                call = RelayCall(
                    f"{request_id}.{self._sequence}",
                    channel,
                    # A whole reply is read as it comes (up to max_reply,
                    # checked by its reader) and may arrive in large batches.
                    max_unread=self.max_unread if stream else 0,
                    on_overflow=self._overflowed,
                )
                frame = protocol.encode(
                    protocol.Request(
                        request_id=call.request_id,
                        model=target.model.name,
                        endpoint=endpoint,
                        body=text,
                        method=method,
                        headers=frame_headers,
                        is_streaming=stream,
                    )
                )
                if _frame_size(frame) > protocol.MAX_FRAME_BYTES:
                    # A worker would drop the connection for a frame over it.
                    if on_close is not None:
                        on_close()
                    raise RelayRefused(
                        413,
                        "The request body is larger than a relay worker accepts "
                        f"({protocol.MAX_FRAME_BYTES} bytes with its framing).",
                    )
                try:
                    response = await self._attempt(call, frame, stream, max_reply)
                except BaseException:
                    if on_close is not None:
                        on_close()  # the requeued worker's in-flight count
                    raise
                if isinstance(response, RelayResponse):
                    response._on_close = on_close
                    if backend_name != target.backend.name:
                        response.backend_name = backend_name
                    return response
                reasons.append(f"{backend_name}: {response}")
            else:
                reasons.append(f"{backend_name}: worker not connected")
            if on_close is not None:
                on_close()
                on_close = None
            if not requeue or len(tried) >= MAX_ATTEMPTS:
                break
            other = _next_worker(
                backends, channels, stats, target.model.name, tried, self.is_gone
            )
            if other is None:
                break
            tried.append(other.name)
            backend_name = other.name
            model = target.model.name
            if other.name != target.backend.name:
                on_close = _ender(stats, other.name, model)
            logger.info("Relay request %s requeued to %s", request_id, other.name)
        raise RelayUnavailable("; ".join(reasons))

    async def _attempt(
        self, call: RelayCall, frame: str, stream: bool, max_reply: int
    ) -> RelayResponse | str:
        """One worker's answer up to its first byte, or why it gave none."""
        link = self.links.get(call.channel)
        arriving = self._arriving.get(call.channel) if link is None else None
        if arriving is not None:
            # Registered in the database, not attached yet (a busy process).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.accept_timeout):
                    await arriving.wait()
            link = self.links.get(call.channel)
        remote = link is None
        if remote:
            if self._layer is None:
                return "no channel layer"
            await self._ready.wait()
            if _process_of(call.channel) == _process_of(self.reply_channel):
                # Its consumer was in this process and is gone: sent over the
                # layer, the request would wait for an answer forever.
                return "worker gone"
        self.calls[call.request_id] = call
        try:
            if link is not None:
                link.start_request(call.request_id, frame, "")
            else:
                await self._layer.send(
                    call.channel,
                    {
                        "type": REQUEST_EVENT,
                        "request_id": call.request_id,
                        "reply_to": self.reply_channel,
                        "frame": frame,
                    },
                )
            pieces: list[bytes] = []
            size = 0
            while True:
                if remote:
                    # The consumer answers, or says within a second that it
                    # took the request; one that does neither (its process
                    # died or stalls) is passed by.
                    try:
                        async with asyncio.timeout(self.accept_timeout):
                            kind, payload = await call.events.get()
                    except TimeoutError:
                        self.finish(call, cancel=True)
                        call.finished = True
                        return f"no answer from its serving process in {self.accept_timeout:g} s"
                    remote = False
                    if kind == ACCEPTED:
                        continue
                else:
                    kind, payload = await call.events.get()
                if kind == "chunk":
                    piece = payload.encode()
                    if stream:
                        return RelayResponse(
                            self, call, 200, _STREAM_HEAD, [piece], done=False
                        )
                    size += len(piece)
                    if size > max_reply:
                        self.finish(call, cancel=True)
                        call.finished = True
                        raise aiohttp.ClientPayloadError("relay reply over the limit")
                    pieces.append(piece)
                elif kind == "complete":
                    status, headers, body = payload
                    if body:
                        pieces.append(body.encode())
                    return RelayResponse(
                        self, call, status, headers or _JSON_HEAD, pieces, done=True
                    )
                else:
                    # Gone, or refused (draining, at capacity, its local
                    # server down): nothing was sent, another worker may
                    # serve it.
                    self.calls.pop(call.request_id, None)
                    call.finished = True
                    return str(payload[0] if kind == "error" else payload)
        except BaseException:
            if not call.finished:
                call.finished = True
                self.finish(call, cancel=True)
            raise

    def _overflowed(self, call: RelayCall) -> None:
        logger.warning(
            "Relay request %s: its client reads slower than the worker sends; "
            "cut after %d characters waiting",
            call.request_id,
            call.max_unread,
        )
        call.finished = True
        self.finish(call, cancel=True)

    async def refresh_models(self, backend_name: str) -> None:
        """Ask `backend_name`'s worker to list its models again and report them."""
        state = self.state()
        channel = state.relay_channels.get(backend_name) if state else None
        if channel and self._layer is not None:
            await self._layer.send(channel, {"type": REFRESH_EVENT})

    def finish(self, call: RelayCall, cancel: bool) -> None:
        """Forget a call; tell its worker to stop when it has not ended."""
        self.calls.pop(call.request_id, None)
        if not cancel:
            return
        link = self.links.get(call.channel)
        if link is not None:
            link.cancel_request(call.request_id, "client disconnected")
        elif self._layer is not None:
            asyncio.get_running_loop().create_task(
                self._send_cancel(call.channel, call.request_id)
            )

    async def _send_cancel(self, channel: str, request_id: str) -> None:
        try:
            await self._layer.send(
                channel, {"type": CANCEL_EVENT, "request_id": request_id}
            )
        except Exception:
            logger.warning(
                "Could not cancel relay request %s", request_id, exc_info=True
            )


_STREAM_HEAD = {"content-type": "text/event-stream"}
_JSON_HEAD = {"content-type": "application/json"}


def _frame_size(frame: str) -> int:
    """The frame's size in bytes on the socket (counted only when it may matter)."""
    if len(frame) * 4 <= protocol.MAX_FRAME_BYTES:
        return len(frame)
    return len(frame.encode())


def _process_of(channel: str) -> str:
    """The part of a channel name that names the process it lives in.

    Channels' layers name a process's channels "<prefix>!<its own part>" (the
    in-memory layer: one prefix, one process).
    """
    return channel.partition("!")[0]


def _next_worker(
    backends: Mapping[str, BackendSpec],
    channels: Mapping[str, str],
    stats: LiveStats,
    model: str,
    tried: list[str],
    is_gone: Callable[[str], bool],
) -> BackendSpec | None:
    """Another connected, healthy relay worker serving `model` with room, least
    loaded first (the router's count: its pong's load or this process's
    requests, the larger); counted in flight when found."""
    candidates = [
        backend
        for name, backend in backends.items()
        if name not in tried
        and name in channels
        and not is_gone(channels[name])
        and backend.kind == RELAY_KIND
        and backend.enabled
        and backend.status == Health.HEALTHY
        and not backend.health_stale
        and any(m.name == model and m.enabled for m in backend.models)
    ]
    candidates.sort(key=lambda backend: stats.load(backend.name))
    for backend in candidates:
        if stats.try_begin(backend, model):
            return backend
    return None


def _ender(stats: LiveStats, backend: str, model: str) -> Callable[[], None]:
    return lambda: stats.end(backend, model)


def relay_backend(response: object) -> str:
    """The backend that served a requeued relay request ("" otherwise)."""
    return response.backend_name if isinstance(response, RelayResponse) else ""
