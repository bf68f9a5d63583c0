"""The worker's connection to the gateway: register, serve requests, reconnect, drain.

One ``Worker`` holds one WebSocket at a time. Its receive loop answers pings,
spawns a task per request (which streams the local backend's answer back as
response_chunk frames), cancels tasks on cancel, re-lists models, and drains on
graceful_shutdown or a signal. Any other end of the connection (dropped, gateway
restarted, secret rejected) is followed by a reconnect after a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Coroutine
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import aiohttp

from nexus_worker.backend import BackendError, LocalBackend
from nexus_worker.forwarding import forward
from nexus_worker.protocol import (
    DEFAULT_HEARTBEAT_SECONDS,
    ERROR_AT_CAPACITY,
    ERROR_BAD_MESSAGE,
    ERROR_DRAINING,
    ERROR_DUPLICATE_REQUEST,
    ERROR_ENDPOINT_NOT_ALLOWED,
    ERROR_MANAGEMENT_NOT_ALLOWED,
    MANAGEMENT_ENDPOINTS,
    MAX_FRAME_BYTES,
    MAX_MEMORY_BYTES,
    MISSED_HEARTBEATS_BEFORE_GONE,
    RELAY_ENDPOINTS,
    SECRET_HEADER,
    BackendState,
    Cancel,
    CloseCode,
    Error,
    GracefulShutdown,
    Message,
    ModelsRefresh,
    ModelsUpdate,
    Ping,
    Pong,
    ProtocolError,
    Register,
    RegisterAck,
    Request,
    Unknown,
    decode,
    encode,
    websocket_url,
)

logger = logging.getLogger("nexus.worker")

CONNECT_TIMEOUT = 15.0
REGISTER_TIMEOUT = 10.0
# The backend's state is read once a heartbeat, each read within this share
# of the interval (and at most STATE_TIMEOUT): a pong never waits for it.
STATE_SHARE = 0.8
STATE_TIMEOUT = 5.0
# ...and before register at most this long (a slow server's state comes with
# the first pongs instead: registering waits for nothing more).
REGISTER_STATE_TIMEOUT = 1.0


@dataclass(frozen=True)
class WorkerConfig:
    """What ``nexus-worker`` was started with (see cli.py for each option)."""

    server: str
    secret: str = field(repr=False)
    backend: str
    name: str
    backend_kind: str = "auto"
    backend_key: str | None = field(default=None, repr=False)
    max_concurrency: int = 4
    models_refresh_secs: float = 60.0
    drain_timeout_secs: float = 120.0
    backend_timeout_secs: float = 300.0
    backoff_first_secs: float = 1.0
    backoff_limit_secs: float = 30.0
    backoff_jitter_secs: float = 0.5
    # What the backend's models may fill, told to the gateway (None: unknown).
    memory_gb: float | None = None
    # Whether the gateway may pull, push, copy, create and delete models on the
    # local (Ollama) server: the machine's owner's choice, off by default.
    allow_model_management: bool = False


class SecretRejected(Exception):
    """The gateway refused the worker's secret (403 or close 4001)."""


class ConnectionLost(Exception):
    """The gateway closed the socket or went silent."""


@dataclass
class Backoff:
    """Exponential delays between reconnects, with jitter; reset on register."""

    first: float
    limit: float
    jitter: float
    attempts: int = 0

    def next_delay(self) -> float:
        delay = min(self.limit, self.first * 2 ** min(self.attempts, 16))
        self.attempts += 1
        return delay + random.uniform(0.0, self.jitter)

    def reset(self) -> None:
        self.attempts = 0


class Worker:
    """The daemon: keeps one registered connection and serves its requests."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.url = websocket_url(config.server, name=config.name)
        self.backoff = Backoff(
            config.backoff_first_secs,
            config.backoff_limit_secs,
            config.backoff_jitter_secs,
        )
        self.models: list[str] = []
        # The backend's state as last read (sent with register and each pong).
        self.state: BackendState | None = None
        # Seconds between the gateway's pings (register_ack, then each ping).
        self.heartbeat = DEFAULT_HEARTBEAT_SECONDS
        self.draining = False
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._send_lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None
        self._backend: LocalBackend | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def load(self) -> int:
        """Requests in flight (what pong reports)."""
        return len(self._tasks)

    async def run(self) -> int:
        """Serve until drained; return the exit status (0)."""
        async with aiohttp.ClientSession() as session:
            self._backend = LocalBackend(
                session,
                self.config.backend,
                kind=self.config.backend_kind,
                api_key=self.config.backend_key,
                read_timeout=self.config.backend_timeout_secs,
            )
            while not self._stop.is_set():
                try:
                    await self._serve_connection(session)
                except SecretRejected:
                    logger.error(
                        "secret rejected by the gateway at %s: check "
                        "NEXUS_WORKER_SECRET (was the worker revoked?)",
                        self.url,
                    )
                except (ConnectionLost, ProtocolError) as exc:
                    if not self.draining:
                        logger.warning("connection to the gateway ended: %s", exc)
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    logger.warning("cannot reach the gateway at %s: %r", self.url, exc)
                if self.draining:
                    break
                delay = self.backoff.next_delay()
                logger.info("reconnecting in %.1f s", delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
            if self._drain_task is not None:
                await self._drain_task
        logger.info("worker stopped")
        return 0

    def drain(self, timeout_secs: float | None = None, reason: str = "") -> None:
        """Take no new requests, finish in-flight ones (up to the timeout), stop."""
        if self.draining:
            logger.info("already draining (%s asked again)", reason or "drain")
            return
        timeout = (
            self.config.drain_timeout_secs if timeout_secs is None else timeout_secs
        )
        logger.info(
            "draining (%s): finishing %d requests, up to %g s",
            reason or "asked to",
            self.load,
            timeout,
        )
        self.draining = True
        self._stop.set()
        self._drain_task = asyncio.create_task(self._drain(timeout))

    def stop_now(self) -> None:
        """Drain without waiting: cancel the requests in flight (a second Ctrl-C)."""
        logger.warning("stopping now: cancelling %d requests", self.load)
        self.drain(0.0, "stop now")
        for task in self._tasks.values():
            task.cancel()

    async def _drain(self, timeout: float) -> None:
        await self._send_if_connected(
            Error(message="worker is draining", code=ERROR_DRAINING)
        )
        tasks = list(self._tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                logger.warning(
                    "drain timeout: %d requests did not finish", len(pending)
                )
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending)
        if self._ws is not None:
            await self._ws.close(code=CloseCode.NORMAL, message=b"drained")

    async def _serve_connection(self, session: aiohttp.ClientSession) -> None:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                ws = await session.ws_connect(
                    self.url,
                    headers={SECRET_HEADER: self.config.secret},
                    max_msg_size=MAX_FRAME_BYTES,
                )
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (401, 403):
                raise SecretRejected from None
            raise
        async with ws:
            if self.draining:  # asked to stop while connecting
                return
            logger.info("connected to %s", self.url)
            self._ws = ws
            chores: list[asyncio.Task[None]] = []
            try:
                heartbeat = await self._register(ws)
                chores.append(asyncio.create_task(self._refresh_periodically()))
                chores.append(
                    asyncio.create_task(self._read_state_periodically(heartbeat))
                )
                await self._receive_loop(ws, heartbeat)
            finally:
                self._ws = None
                for chore in chores:
                    chore.cancel()
                await self._cancel_all()

    async def _register(self, ws: aiohttp.ClientWebSocketResponse) -> float:
        """Send register, wait for register_ack; return the heartbeat interval."""
        await self._list_models()
        await self._read_state(REGISTER_STATE_TIMEOUT)
        await self._send(
            Register(
                name=self.config.name,
                models=self.models,
                max_concurrency=self.config.max_concurrency,
                load=self.load,
                backend_kind=self._backend_kind(),
                version=_version(),
                state=self.state,
            )
        )
        message = await self._receive(ws, REGISTER_TIMEOUT)
        if not isinstance(message, RegisterAck):
            raise ConnectionLost(f"expected register_ack, got {message!r:.200}")
        self.backoff.reset()
        logger.info(
            "registered as %s; the gateway routes %d models here: %s",
            message.worker_id,
            len(message.models),
            ", ".join(message.models[:20]) or "none",
        )
        return message.heartbeat_interval

    async def _receive_loop(
        self, ws: aiohttp.ClientWebSocketResponse, heartbeat: float
    ) -> None:
        # The gateway pings every interval and gives up on a worker that left
        # MISSED_HEARTBEATS_BEFORE_GONE pings unanswered; this side gives up
        # two intervals later than that (a busy gateway's pings come late).
        # A gateway with many workers stretches the interval and says so in
        # its pings.
        self.heartbeat = heartbeat
        while True:
            silence_limit = self.heartbeat * (MISSED_HEARTBEATS_BEFORE_GONE + 2)
            try:
                message = await self._receive(ws, silence_limit)
            except ProtocolError as exc:
                logger.warning("ignoring a bad frame from the gateway: %s", exc)
                await self._send(
                    Error(
                        message=str(exc)[:500],
                        request_id=exc.request_id,
                        code=ERROR_BAD_MESSAGE,
                    )
                )
                continue
            self._handle(message)

    async def _receive(
        self, ws: aiohttp.ClientWebSocketResponse, timeout: float
    ) -> Message | Unknown:
        """Return the next message; raise ConnectionLost (SecretRejected) at the end."""
        while True:
            try:
                frame = await ws.receive(timeout=timeout)
            except TimeoutError:
                raise ConnectionLost(
                    f"no word from the gateway for {timeout:g} s"
                ) from None
            if frame.type == aiohttp.WSMsgType.TEXT:
                return decode(frame.data)
            if frame.type in _CLOSED:
                code = ws.close_code
                if code == CloseCode.AUTH_FAILED:
                    raise SecretRejected
                if code == CloseCode.UNSUPPORTED_VERSION:
                    raise ConnectionLost("the gateway speaks another protocol version")
                if code == CloseCode.RATE_LIMITED:
                    raise ConnectionLost(
                        "the gateway asks this worker to slow down (4029: it "
                        "reconnected or sent too fast)"
                    )
                if code == CloseCode.AUTH_THROTTLED:
                    raise ConnectionLost(
                        "too many failed authentications from this address: "
                        "the gateway refuses it for a while (4030)"
                    )
                if code == CloseCode.NOT_SERVED_HERE:
                    raise ConnectionLost(
                        "this address is a control-only Nexus (NEXUS_ROLE=control, "
                        "4404): point the worker at the gateway's address"
                    )
                raise ConnectionLost(f"the gateway closed the connection ({code})")
            if frame.type == aiohttp.WSMsgType.ERROR:
                raise ConnectionLost(f"WebSocket error: {ws.exception()!r}")
            logger.debug("ignoring a %s frame", frame.type.name)

    def _handle(self, message: Message | Unknown) -> None:
        if isinstance(message, Request):
            self._start_request(message)
        elif isinstance(message, Ping):
            if message.interval is not None:
                self.heartbeat = message.interval
            pong = Pong(timestamp=message.timestamp, load=self.load, state=self.state)
            self._spawn(self._send(pong))
        elif isinstance(message, Cancel):
            task = self._tasks.get(message.request_id)
            if task is not None:
                logger.info("cancelling %s: %s", message.request_id, message.reason)
                task.cancel()
        elif isinstance(message, ModelsRefresh):
            self._spawn(self._refresh_models(always=True))
        elif isinstance(message, GracefulShutdown):
            self.drain(message.timeout_secs, message.reason or "the gateway asked")
        elif isinstance(message, Error):
            logger.warning(
                "the gateway reports: %s (%s)", message.message, message.code
            )
        elif isinstance(message, Unknown):
            logger.info("ignoring a message of unknown type %r", message.type_name)
        else:
            logger.info("ignoring an unexpected %s message", message.type)

    def _start_request(self, request: Request) -> None:
        refusal = self._refusal(request)
        if refusal is not None:
            code, text = refusal
            logger.warning("refusing request %s: %s", request.request_id, text)
            self._spawn(
                self._send(
                    Error(message=text, request_id=request.request_id, code=code)
                )
            )
            return
        task = asyncio.create_task(self._serve_request(request))
        self._tasks[request.request_id] = task
        task.add_done_callback(lambda done: self._forget(request.request_id, done))

    def _refusal(self, request: Request) -> tuple[str, str] | None:
        """Return (code, message) if this request must not reach the backend."""
        if MANAGEMENT_ENDPOINTS.get(request.endpoint) == request.method:
            refusal = self._management_refusal()
            if refusal is not None:
                return ERROR_MANAGEMENT_NOT_ALLOWED, refusal
        elif request.method != "POST" or request.endpoint not in RELAY_ENDPOINTS:
            endpoint = f"{request.method} {request.endpoint[:100]}"
            return ERROR_ENDPOINT_NOT_ALLOWED, f"{endpoint} is not forwarded here"

        if self.draining:
            return ERROR_DRAINING, "the worker is draining"
        if request.request_id in self._tasks:
            return ERROR_DUPLICATE_REQUEST, "a request with this id is in flight"
        if self.load >= self.config.max_concurrency:
            return ERROR_AT_CAPACITY, f"the worker is at {self.load} requests"
        return None

    def _management_refusal(self) -> str | None:
        """Why this worker does not take model management (None: it does)."""
        if not self.config.allow_model_management:
            return (
                "this worker does not manage models: its owner did not start "
                "it with --allow-model-management"
            )
        kind = self._backend.kind if self._backend is not None else "auto"
        if kind != "ollama":
            return (
                f"this worker's local server is not Ollama (it speaks {kind}): "
                "only Ollama pulls, pushes, copies, creates and deletes models"
            )
        return None

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        self._tasks.pop(request_id, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("request %s failed", request_id, exc_info=task.exception())

    async def _serve_request(self, request: Request) -> None:
        try:
            assert self._backend is not None
            if request.endpoint in MANAGEMENT_ENDPOINTS:
                # The models changed (or may have): the gateway hears before
                # the answer ends, not at the next periodic refresh.
                await forward(
                    self._backend,
                    request,
                    self._send,
                    lambda: self._refresh_models(always=False),
                )
            else:
                await forward(self._backend, request, self._send)
        except ConnectionError:
            logger.info(
                "request %s: the gateway connection is gone", request.request_id
            )

    async def _refresh_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.models_refresh_secs)
            await self._refresh_models(always=False)

    async def _refresh_models(self, *, always: bool) -> None:
        """Re-list the backend's models; send models_update if changed (or asked)."""
        before = self.models
        await self._list_models()
        if always or self.models != before:
            logger.info("models: %s", ", ".join(self.models[:20]) or "none")
            await self._send_if_connected(
                ModelsUpdate(models=self.models, load=self.load)
            )

    async def _read_state_periodically(self, heartbeat: float) -> None:
        """Read the backend's state once a heartbeat, for the next pong."""
        timeout = min(heartbeat * STATE_SHARE, STATE_TIMEOUT)
        while True:
            await asyncio.sleep(heartbeat)
            await self._read_state(timeout)

    async def _read_state(self, timeout: float) -> None:
        """Update self.state from the backend (unknown but for the memory if
        it does not answer in time: an old state would mislead)."""
        assert self._backend is not None
        memory = self.config.memory_gb
        memory_bytes = (
            None if memory is None else min(int(memory * 1e9), MAX_MEMORY_BYTES)
        )
        try:
            async with asyncio.timeout(timeout):
                self.state = await self._backend.read_state(self.models, memory_bytes)
        except TimeoutError:
            self.state = BackendState(memory_bytes=memory_bytes)

    async def _list_models(self) -> None:
        """Update self.models from the backend; keep the last list if it fails."""
        assert self._backend is not None
        try:
            self.models = await self._backend.list_models()
        except BackendError as exc:
            logger.warning("cannot list the local backend's models: %s", exc)

    def _backend_kind(self) -> str | None:
        kind = self._backend.kind if self._backend is not None else "auto"
        return None if kind == "auto" else kind

    async def _send(self, message: Message) -> None:
        """Send one frame; raise ConnectionError if the socket is gone."""
        ws = self._ws
        if ws is None or ws.closed:
            raise ConnectionResetError("not connected to the gateway")
        async with self._send_lock:
            await ws.send_str(encode(message))

    async def _send_if_connected(self, message: Message) -> None:
        try:
            await self._send(message)
        except ConnectionError:
            logger.debug("not sent (disconnected): %s", message.type)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a short send in the background so the receive loop never waits."""
        task = asyncio.create_task(self._quietly(coroutine))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _quietly(self, coroutine: Coroutine[Any, Any, None]) -> None:
        with contextlib.suppress(ConnectionError):
            await coroutine

    async def _cancel_all(self) -> None:
        """The socket is gone: answers can no longer be delivered, so stop them."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            logger.warning("disconnected: abandoned %d requests", len(tasks))
            await asyncio.wait(tasks)


_CLOSED = (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED)


def _version() -> str:
    # Installed on its own (nexus_worker/pyproject.toml) or with the gateway.
    for distribution in ("nexus-worker", "nexus"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"
