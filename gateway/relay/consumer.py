"""The gateway end of a worker's WebSocket: ``/ws/workers/``.

One ``WorkerConsumer`` per connected worker, in whichever serving process
accepted the socket. It authenticates the worker by the ``x-worker-secret``
header (a bad or revoked secret: accepted, then closed with 4001 and no
details), takes its ``register``, makes it a ``relay`` backend
(backends/workers.py) and from then on:

* passes requests to the worker, from this process (``RelayHub`` calls
  ``start_request``) or from any other over the channel layer
  (``relay.request`` events to this consumer's channel), and sends each piece
  of the worker's answer back to the process that asked, in order;
* pings at the heartbeat clock's turns (gateway/relay/heartbeats.py); a
  worker that leaves 3 pings unanswered is Gone (socket closed, backend
  unhealthy, its requests fail over);
* obeys the admin and API over the channel layer: close (revoked, 4001),
  drain (graceful_shutdown), refresh (models_refresh).

Frames are bounded (16 MiB, bigger closes with 1009), malformed ones are
logged and dropped, unknown types logged and ignored (the log at most 10
lines a minute per worker); a frame nested too deep or holding too many
values (or one the decoder cannot cope with) closes the socket with 4003 and
the worker is Gone at once: nothing a worker sends can crash the consumer.

What a worker may cost the process is bounded (gateway/relay/limits.py):
frames and bytes per second (over the rate its socket is not read; over for
too long with no request to answer, it is closed with 4029), connects and
models_updates per
credential (a connect over the rate is closed with 4029 before any database
work; a models_update over it waits and the latest is applied), failed
authentications per address (then closed with 4030 without a check); and the
configuration versions its comings and goings make are coalesced
(gateway/relay/churn.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any
from urllib.parse import parse_qs

from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from backends.worker_models import describe_refusals
from backends.workers import (
    CLOSE_EVENT,
    DRAIN_EVENT,
    REFRESH_EVENT,
    Registration,
    Worker,
    drain_worker,
    forget_worker,
    register_worker,
    update_worker_models,
)
from gateway.relay.dispatch import (
    ACCEPTED,
    CANCEL_EVENT,
    REQUEST_EVENT,
    Event,
    RelayHub,
)
from gateway.relay.limits import FrameMeter, LogBudget, RelayGuard
from nexus_worker import protocol

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT = 10.0
# Requests one worker may hold at once beyond its max_concurrency (races
# between processes): past this many it is refused with "at_capacity".
_SLACK = 16

# A request from another process that has no answer yet after this long gets
# an "accepted" event back (that process gives up on a silent consumer after
# 3 heartbeats, at least 5 s: gateway/relay/dispatch.py).
ACCEPT_NOTICE_SECONDS = 1.0

# The error code telling a worker which of its models are refused.
MODELS_REFUSED = "models_refused"

# Events waiting for the channel layer, per request, before it is failed.
_MAX_BACKLOG = 4096


class _Route:
    """Where one request's answer goes ("" : this process) and what is still
    to be sent there."""

    __slots__ = ("flushing", "pending", "reply_to", "seq")

    def __init__(self, reply_to: str) -> None:
        self.reply_to = reply_to
        self.seq = 0
        self.pending: list[Event] = []
        self.flushing = False


# Channels maps an event's "type" to a handler method: dots become underscores.
assert REQUEST_EVENT == "relay.request" and CANCEL_EVENT == "relay.cancel"
assert (CLOSE_EVENT, DRAIN_EVENT, REFRESH_EVENT) == (
    "relay.close",
    "relay.drain",
    "relay.refresh",
)


def _header(scope: dict[str, Any], name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return ""


def _address(scope: dict[str, Any]) -> str:
    client = scope.get("client")
    return str(client[0]) if client else ""


def _reading(scope: dict[str, Any]) -> dict[str, Any]:
    """The server's hooks to stop and resume reading the socket (Daphne's,
    nexus_site/servers/daphne_relay.py); other servers stop reading by
    themselves while the consumer waits (a bounded queue)."""
    hooks = scope.get("extensions", {}).get("nexus.reading")
    return hooks if isinstance(hooks, dict) else {}


def _nothing() -> None:
    pass


def _load(message: protocol.Register | protocol.Pong) -> int:
    """A worker's load: its requests in flight, or its backend's busy slots
    when more (clients of its own)."""
    busy = message.state.busy_slots if message.state is not None else None
    return max(message.load, busy or 0)


class WorkerConsumer(AsyncWebsocketConsumer):
    """One worker's socket (see the module docstring)."""

    def __init__(
        self, *args: Any, hub: RelayHub, guard: RelayGuard | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        # This process's relay hub and limits:
        # ``WorkerConsumer.as_asgi(hub=gateway.relay, guard=gateway.relay_guard)``.
        self.hub = hub
        self.guard = guard if guard is not None else RelayGuard()
        self.complaints = LogBudget()
        self.meter: FrameMeter | None = None  # once authenticated
        self._models_due: protocol.ModelsUpdate | None = None
        self.worker_id: int | None = None
        self.backend_name = ""
        self.registered = False
        # Pings sent since the worker's last pong (3 unanswered: Gone).
        self.unanswered = 0
        self.max_concurrency = 1
        # Requests sent to the worker and not finished, by request id.
        self.routes: dict[str, _Route] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._closing = False
        self._gone = False  # disconnect() ran
        self.draining = False  # it takes no new requests

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch without its ``close_old_connections`` per message.

        Channels runs that in the sync thread before every message it hands
        to a handler: here every frame of a worker's answer, a thread round
        trip per chunk, queued behind any database call of the process (the
        profile of ``make bench BENCH_ARGS=--relay`` showed it). This
        consumer touches the database only through ``database_sync_to_async``,
        which closes old connections itself.
        """
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    # Connection ----------------------------------------------------------------

    async def connect(self) -> None:
        secret = _header(self.scope, protocol.SECRET_HEADER.encode())
        address = _address(self.scope)
        if not await self._may_try(address, secret):
            return
        worker = await database_sync_to_async(Worker.objects.for_secret)(secret)
        await self.accept()
        if worker is None:
            # Logged by the throttle: a line per address per minute at most.
            self.guard.auth.failed(address)
            await self._close(protocol.CloseCode.AUTH_FAILED)
            return
        self.worker_id = worker.pk
        self.backend_name = worker.name
        self.meter = self.guard.frame_meter(worker.pk)
        name = parse_qs(self.scope.get("query_string", b"").decode()).get("name")
        logger.info(
            "Relay worker %s connected from %s%s",
            worker.name,
            _address(self.scope),
            f" (calls itself {name[0][:100]!r})" if name else "",
        )
        self._tasks.append(
            asyncio.get_running_loop().create_task(self._await_register())
        )

    async def _may_try(self, address: str, secret: str) -> bool:
        """Refuse, before any database work, an address that keeps failing to
        authenticate (4030) and a credential that reconnects too often
        (4029); return whether the connection may go on."""
        code = self.guard.refusal(address, secret)
        if not code:
            return True
        await self.accept()
        await self._close(code, "slow down: retry later")
        return False

    async def disconnect(self, code: int) -> None:
        if self._gone:
            return
        self._gone = True
        for task in self._tasks:
            task.cancel()
        self.hub.detach(self.channel_name)
        self.hub.heartbeats.leave(self)
        if self.registered:
            self.hub.report_load(self.backend_name, None, self.channel_name)
            if self.worker_id is not None:
                self.hub.registry.leave(self.worker_id, self.channel_name)
        routes, self.routes = self.routes, {}
        for request_id, route in routes.items():
            self._pass_on(request_id, route, ("gone", "worker gone"))
        if self.registered and self.worker_id is not None:
            logger.info("Relay worker %s gone (close %s)", self.backend_name, code)
            await self.guard.churn.run(
                forget_worker,
                self.worker_id,
                self.channel_name,
                f"worker disconnected ({code})",
            )

    async def leave(self) -> None:
        """This serving process stops: Gone here; the worker reconnects."""
        await self._close(protocol.CloseCode.NORMAL)
        await self.disconnect(protocol.CloseCode.NORMAL)

    async def _drop(self, code: int) -> None:
        """Close the socket and make the worker Gone now, everywhere: its
        backend unhealthy, its requests failed over (rather than when Daphne
        reports the socket closed)."""
        await self._close(code)
        await self.disconnect(code)

    async def _cut(self, code: int) -> None:
        """Drop a hostile worker: not a byte more is read from its socket
        (the server closes it a second later if the worker sends no close)."""
        _reading(self.scope).get("pause", _nothing)()
        await self._drop(code)

    async def _close(self, code: int, reason: str = "") -> None:
        self._closing = True
        # Daphne's websocket library sends 1000 and 3000-4999 only, as plain
        # ints (and no reason); an oversized frame gets its 1009 from Daphne's
        # own limit (--websocket-max-message-size, the protocol's 16 MiB under
        # nexus_run).
        code = int(code)
        await self.close(
            code=code if code == 1000 or 3000 <= code <= 4999 else 1000,
            reason=reason or None,
        )

    async def _await_register(self) -> None:
        await asyncio.sleep(REGISTER_TIMEOUT)
        if not self.registered and not self._closing:
            logger.warning("Relay worker %s sent no register", self.backend_name)
            await self._close(protocol.CloseCode.NORMAL)

    # Frames from the worker ----------------------------------------------------

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None
    ) -> None:
        if self.worker_id is None or self._closing:
            return
        size = len(text_data) if text_data is not None else len(bytes_data or b"")
        if not await self._within_rate(size):
            return
        if text_data is None:
            self._complain("sent a binary frame")
            return
        if len(text_data) > protocol.MAX_FRAME_BYTES:
            await self._close(protocol.CloseCode.TOO_BIG)
            return
        try:
            message = protocol.decode(text_data)
        except protocol.UnsupportedVersion as error:
            logger.warning("Relay worker %s: %s", self.backend_name, error)
            await self._close(protocol.CloseCode.UNSUPPORTED_VERSION)
            return
        except protocol.UnreadableFrame as error:
            logger.warning("Relay worker %s: %s: closed", self.backend_name, error)
            await self._cut(protocol.CloseCode.BAD_FRAME)
            return
        except protocol.ProtocolError as error:
            self._complain("bad frame: %s", error)
            return
        except Exception:
            # The decoder itself broke (it should not): a consumer that let
            # this escape would die without its disconnect, leaving a ghost
            # worker that takes requests for half a minute.
            logger.exception("Relay worker %s: undecodable frame", self.backend_name)
            await self._drop(protocol.CloseCode.BAD_FRAME)
            return
        try:
            await self._handle(message)
        except Exception:
            # One bad message costs that message, never the worker's socket.
            logger.exception("Relay worker %s: handling failed", self.backend_name)

    async def _within_rate(self, size: int) -> bool:
        """Count a frame against the worker's rates; while it is over them,
        stop reading its socket until they allow the frame. A worker over
        them for too long with no request to answer is closed (4029): what it
        sends is of no use to anyone. Return whether to handle the frame."""
        assert self.meter is not None
        now = time.monotonic()
        wait = self.meter.charge(size, now)
        if wait == 0:
            return True
        if not self.routes and self.meter.is_over_too_long(now, wait):
            logger.warning(
                "Relay worker %s over %g frames/s or %g bytes/s for %g s "
                "with no request to answer: closed",
                self.backend_name,
                self.guard.limits.frames_per_second,
                self.guard.limits.bytes_per_second,
                self.guard.limits.throttle_seconds,
            )
            await self._cut(protocol.CloseCode.RATE_LIMITED)
            return False
        reading = _reading(self.scope)
        reading.get("pause", _nothing)()
        try:
            await asyncio.sleep(wait)
        finally:
            reading.get("resume", _nothing)()
        return not self._closing

    def _complain(self, text: str, *args: Any) -> None:
        """Log what a worker did wrong, at most 10 lines a minute per worker."""
        held = self.complaints.allow(time.monotonic())
        if held is not None:
            logger.warning(
                "Relay worker %s: "
                + text
                + (f" ({held} more not logged)" if held else ""),
                self.backend_name,
                *args,
            )

    async def _handle(self, message: protocol.Message | protocol.Unknown) -> None:
        if isinstance(message, protocol.Unknown):
            self._complain("unknown message type %r ignored", message.type_name)
        elif not self.registered:
            if isinstance(message, protocol.Register):
                await self._register(message)
            else:
                self._complain("message before register")
        elif isinstance(message, protocol.ResponseChunk):
            self._forward(message.request_id, ("chunk", message.chunk), False)
        elif isinstance(message, protocol.ResponseComplete):
            done: Event = ("complete", (message.status, message.headers, message.body))
            self._forward(message.request_id, done, True)
        elif isinstance(message, protocol.Error):
            if message.request_id:
                failed: Event = ("error", (message.message, message.code))
                self._forward(message.request_id, failed, True)
            elif message.code == protocol.ERROR_DRAINING:
                logger.info("Relay worker %s: draining", self.backend_name)
                self.draining = True
                assert self.worker_id is not None
                await self.guard.churn.run(drain_worker, self.worker_id)
            else:
                self._complain("%s", message.message)
        elif isinstance(message, protocol.Pong):
            # Only a pong that answers a ping is published to every process:
            # unasked ones would each cost a message to all of them.
            if self.unanswered:
                self.unanswered = 0
                assert self.worker_id is not None
                self.hub.registry.note(self.worker_id, message.state)
                self.hub.report_load(self.backend_name, _load(message))
        elif isinstance(message, protocol.ModelsUpdate):
            await self._update_models(message)
        else:
            self._complain("unexpected %s ignored", message.type)

    async def _update_models(self, message: protocol.ModelsUpdate) -> None:
        """Apply a models_update, or, over the credential's rate, hold it and
        apply the latest one held when the rate allows."""
        assert self.worker_id is not None
        wait = self.guard.model_updates.admit(str(self.worker_id), time.monotonic())
        if wait > 0:
            if self._models_due is None:
                self._tasks.append(
                    asyncio.get_running_loop().create_task(self._update_later(wait))
                )
            self._models_due = message
            return
        await self._apply_models(message)

    async def _apply_models(self, message: protocol.ModelsUpdate) -> None:
        assert self.worker_id is not None
        self.hub.report_load(self.backend_name, message.load)
        update = await self.guard.churn.run(
            update_worker_models, self.worker_id, message.models
        )
        self.hub.registry.rewrite(self.worker_id)
        await self._tell_refused(update)

    async def _update_later(self, wait: float) -> None:
        while self._models_due is not None:
            await asyncio.sleep(wait)
            assert self.worker_id is not None
            wait = self.guard.model_updates.admit(str(self.worker_id), time.monotonic())
            if wait <= 0:
                message, self._models_due = self._models_due, None
                try:
                    await self._apply_models(message)
                except Exception:
                    logger.exception(
                        "Relay worker %s: models_update failed", self.backend_name
                    )

    async def _register(self, message: protocol.Register) -> None:
        assert self.worker_id is not None
        # Once the database has it, a snapshot may route to this channel
        # before this consumer attaches below: such a request waits for it.
        self.hub.arriving(self.channel_name)
        try:
            registration, previous = await self.guard.churn.run(
                register_worker,
                self.worker_id,
                self.channel_name,
                _address(self.scope),
                message.models,
                message.max_concurrency,
            )
        except Worker.DoesNotExist:
            self.hub.not_arriving(self.channel_name)
            await self._close(protocol.CloseCode.AUTH_FAILED)
            return
        except BaseException:
            self.hub.not_arriving(self.channel_name)
            raise
        self.registered = True
        self.max_concurrency = message.max_concurrency
        self.hub.report_load(self.backend_name, _load(message))
        self.hub.attach(self.channel_name, self)
        self.hub.registry.join(
            self.worker_id,
            self.channel_name,
            message.max_concurrency,
            self._lost,
            message.state,
        )
        if previous and self.channel_layer is not None:
            # The same worker reconnected before its old socket was seen gone.
            with contextlib.suppress(Exception):
                await self.channel_layer.send(
                    previous, {"type": CLOSE_EVENT, "code": protocol.CloseCode.NORMAL}
                )
        await self._send(
            protocol.RegisterAck(
                worker_id=str(registration.worker_id),
                models=list(registration.models),
                heartbeat_interval=self.hub.heartbeats.join(self),
            )
        )
        await self._tell_refused(registration)
        logger.info(
            "Relay worker %s registered: %d models, max concurrency %d",
            self.backend_name,
            len(registration.models),
            message.max_concurrency,
        )

    async def _lost(self) -> None:
        """The database says this worker may not stay: revoked, or connected
        again elsewhere (``backends.workers.see_workers``)."""
        await self._close(protocol.CloseCode.AUTH_FAILED)

    async def _tell_refused(self, accepted: Registration) -> None:
        """Tell the worker which of its models it is not sent (its log shows
        it): not in its credential's allow-list, or a direct backend's."""
        if accepted.refused:
            text = describe_refusals(accepted.refused)
            await self._send(
                protocol.Error(
                    message=f"models not routed here: {text}"[:2000],
                    code=MODELS_REFUSED,
                )
            )

    def _forward(self, request_id: str, event: Event, last: bool) -> None:
        route = (
            self.routes.pop(request_id, None) if last else self.routes.get(request_id)
        )
        if route is not None:  # else cancelled, or not ours: nobody waits for it
            self._pass_on(request_id, route, event)

    def _pass_on(self, request_id: str, route: _Route, event: Event) -> None:
        """Hand an event to the process that asked: at once when it is this one,
        else through the channel layer, in order, in batches while a send is
        under way (so a slow layer costs messages, not one round trip per
        chunk)."""
        if not route.reply_to:
            self.hub.deliver(request_id, event)
            return
        route.pending.append(event)
        if len(route.pending) > _MAX_BACKLOG:
            # The layer does not keep up: fail this request rather than hold
            # its stream in memory.
            route.pending = [("gone", "the relay fell behind")]
            self.cancel_request(request_id, "relay backlog")
        if not route.flushing:
            route.flushing = True
            asyncio.get_running_loop().create_task(self._flush(request_id, route))

    async def _flush(self, request_id: str, route: _Route) -> None:
        try:
            while route.pending:
                events, route.pending = route.pending, []
                seq = route.seq
                route.seq += len(events)
                await self.hub.send_events(route.reply_to, request_id, seq, events)
        except Exception:
            logger.warning(
                "Relay worker %s: could not pass on an answer to %s",
                self.backend_name,
                request_id,
                exc_info=True,
            )
        finally:
            route.flushing = False

    # Heartbeats ------------------------------------------------------------------

    async def beat(self, interval: float) -> None:
        """The heartbeat clock's turn (gateway/relay/heartbeats.py): ping the
        worker, saying when the next ping comes at most; a worker that left 3
        pings unanswered is Gone.

        Pings sent, not time since the last pong, make it Gone: a serving
        process that stalled (a busy machine, a slow database) sent no pings
        meanwhile, and must not blame its workers for its own silence. A
        heartbeat costs no database work: the pongs go to the hub's registry
        (gateway/relay/registry.py), which the database hears from now and then.
        """
        if self._closing:
            self.hub.heartbeats.leave(self)
            return
        if self.unanswered >= protocol.MISSED_HEARTBEATS_BEFORE_GONE:
            logger.warning(
                "Relay worker %s missed %d heartbeats: gone",
                self.backend_name,
                self.unanswered,
            )
            self.hub.heartbeats.leave(self)
            await self._close(protocol.CloseCode.NORMAL)
            return
        self.unanswered += 1
        await self._send(protocol.Ping(timestamp=time.time(), interval=interval))

    async def _send(self, message: protocol.Message) -> None:
        if not self._closing:
            await self.send(text_data=protocol.encode(message))

    # Requests (RelayHub in this process, or the channel layer) -----------------

    def start_request(self, request_id: str, frame: str, reply_to: str) -> None:
        route = _Route(reply_to)
        if self.draining or self._closing:
            refusal = ("worker draining", protocol.ERROR_DRAINING)
            self._pass_on(request_id, route, ("error", refusal))
            return
        if len(self.routes) >= self.max_concurrency + _SLACK:
            refusal = ("worker at capacity", protocol.ERROR_AT_CAPACITY)
            self._pass_on(request_id, route, ("error", refusal))
            return
        self.routes[request_id] = route
        loop = asyncio.get_running_loop()
        if reply_to:
            # The process that asked waits for a sign of life: the answer, or
            # when that is slow, a word that the request was taken (not sent
            # for a quick answer: it would cost a message through the layer).
            loop.call_later(ACCEPT_NOTICE_SECONDS, self._notice, request_id, route)
        loop.create_task(self.send(text_data=frame))

    def _notice(self, request_id: str, route: _Route) -> None:
        """Tell the process that asked that its request was taken, unless it
        heard something of it already (or it ended)."""
        if (
            self.routes.get(request_id) is route
            and not route.seq
            and not route.flushing
        ):
            self._pass_on(request_id, route, (ACCEPTED, None))

    def cancel_request(self, request_id: str, reason: str) -> None:
        if self.routes.pop(request_id, None) is not None and not self._closing:
            frame = protocol.encode(
                protocol.Cancel(request_id=request_id, reason=reason)
            )
            asyncio.get_running_loop().create_task(self.send(text_data=frame))

    async def relay_request(self, event: dict[str, Any]) -> None:
        self.start_request(
            str(event.get("request_id", "")),
            str(event.get("frame", "")),
            str(event.get("reply_to", "")),
        )

    async def relay_cancel(self, event: dict[str, Any]) -> None:
        self.cancel_request(str(event.get("request_id", "")), "client disconnected")

    # The admin, API and commands -----------------------------------------------

    async def relay_close(self, event: dict[str, Any]) -> None:
        await self._close(int(event.get("code", protocol.CloseCode.AUTH_FAILED)))

    async def relay_drain(self, event: dict[str, Any]) -> None:
        logger.info("Relay worker %s: draining", self.backend_name)
        self.draining = True
        await self._send(
            protocol.GracefulShutdown(
                reason=str(event.get("reason") or "") or None,
                timeout_secs=float(event.get("timeout") or 0) or None,
            )
        )

    async def relay_refresh(self, event: dict[str, Any]) -> None:
        await self._send(protocol.ModelsRefresh())
