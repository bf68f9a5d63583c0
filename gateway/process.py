"""One gateway per serving process: all its live state, with one lifecycle.

The ASGI wiring (nexus_site/asgi.py) builds a ``Gateway`` from the settings and
hands it to the proxy (``ProxyApp(gateway)``), the usage stream and /metrics.
It owns what a serving process keeps between requests: the snapshot holder,
the router and its live stats (in flight, latency, open circuits), the circuit
breaker and the error cache, the usage buffer and its shipper, the live usage counters and their
publisher, the upstream HTTP client and the metrics.

Whatever runs in the background is a service (nexus_lib.service), listed once
in ``Gateway.services``: ``start()`` starts them in that order on the running
loop, ``stop()`` stops them in reverse within the drain period (at least 5 s;
the usage sink hands on the usage still held as it stops); ``drain()`` is the
graceful part of a shutdown, before ``stop()``.

Tests build their own gateways; Django views that need the serving process's
live numbers ask ``current_gateway()``, which builds one on first use only
where the ASGI wiring installed none (tests, a Django test client).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from channels.db import database_sync_to_async
from django.conf import settings

from backends.workers import record_worker_states, see_workers, sweep_silent_workers
from gateway.admission import AdmissionGate
from gateway.admission_places import LocalPlaces, Places, SharedPlaces
from gateway.breaker import BREAKER_GROUP, BreakerSettings, CircuitBreaker
from gateway.cache import ResponseCache
from gateway.client import ReplyLimits, UpstreamClient
from gateway.context_limits import CONTEXT_GROUP, SharedContextLimits
from gateway.error_cache import ErrorCache
from gateway.fleet.scheduler import FleetScheduler
from gateway.holder import SnapshotHolder
from gateway.metrics import GatewayMetrics, MetricsEndpoint, Network, parse_networks
from gateway.prefix import PrefixIndex
from gateway.relay.dispatch import LOAD_GROUP, RelayHub
from gateway.relay.heartbeats import HeartbeatClock
from gateway.relay.limits import RelayGuard
from gateway.tracing import Tracing
from nexus_lib.groups import listen_to_group
from nexus_lib.service import (
    Service,
    TaskService,
    periodic,
    start_in_order,
    stop_in_reverse,
)
from nexus_worker import protocol
from routing.core import Health, LiveStats, Router, RouterSnapshot
from routing.snapshot import build_state
from routing.state import GatewayState
from routing.versioning import read_config_version
from usage.buffer import UsageBuffer
from usage.flush import DatabaseFlusher
from usage.limits.limiter import Limiter, LocalLimiter
from usage.limits.spend import read_budget_spend
from usage.live import LiveUsage
from usage.progress import OpenRequests
from usage.publisher import USAGE_GROUP, UsagePublisher
from usage.spill import UsageSpill

logger = logging.getLogger(__name__)

GAUGE_REFRESH_SECONDS = 1.0
# A relay worker whose heartbeats stopped reaching the database for this many
# heartbeats (and at least RELAY_SILENCE_MIN_SECONDS: a slow database must not
# sweep a live process's workers), on a serving process that does not hold its
# socket, is Gone.
RELAY_SILENCE_HEARTBEATS = 3
RELAY_SILENCE_MIN_SECONDS = 10.0
# What relay workers report that changed is written this often, all together.
RELAY_STATE_WRITE_SECONDS = 1.0
# A drain period of 0 refuses to wait for requests in flight, not for the usage
# to be handed on: stopping the services may take at least this long.
STOP_SECONDS_MIN = 5.0
# ...and at most this long, so that a drain and a stop that both use all their
# time still end inside the launcher's grace after the drain period
# (nexus_site/launcher.py STOP_GRACE_SECONDS, 10 s) before it kills the process.
STOP_SECONDS_MAX = 8.0
# Collect the young generation less often: a proxy allocates many short-lived
# objects per request and keeps few, so the default 700 runs it constantly.
GC_THRESHOLDS = (7000, 20, 20)
# What a stopping process waits for its last spans to be exported.
TRACES_FLUSH_SECONDS = 3.0


class UsageSink(Protocol):
    """Hands the buffer's events on: to the database, or to a Redis stream."""

    @property
    def name(self) -> str: ...
    def start(self) -> None: ...
    async def stop(self) -> None: ...
    def flush_on_exit(self) -> None: ...


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The settings a gateway runs with (read once, passed in)."""

    auth_required: bool = True
    max_body_bytes: int = 16 * 1024 * 1024
    # A body still arriving this long after the head gets a 408 (the servers
    # that hand the application the head first: uvicorn, granian).
    client_body_timeout: float = 120.0
    # An Ollama model file (/api/blobs/<digest>): its size, and the time it
    # may take to arrive and to reach the backend.
    max_blob_bytes: int = 256 * 1024**3
    blob_timeout: float = 3600.0
    connect_timeout: float = 5.0
    max_connections: int = 1000
    max_reply_bytes: int = 32 * 1024 * 1024
    max_event_bytes: int = 1024 * 1024
    max_unsent_bytes: int = 1024 * 1024
    stall_seconds: float = 10.0
    max_streams_per_key: int = 64  # in this process; 0: no cap
    config_poll_interval: float = 1.0
    usage_buffer_max: int = 100_000
    usage_transport: str = "database"  # or "redis"
    usage_progress_interval: float = 2.0
    access_log: bool = True
    drain_seconds: float = 30.0
    metrics_allow: tuple[str | Network, ...] = ("127.0.0.0/8", "::1/128")
    metrics_token: str = ""
    metrics_per_key: bool = False
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    # Seconds a backend that refused a connection is skipped (0: never).
    error_cache_seconds: float = 10.0
    # How admission control learns its share of the band: "single" (the only
    # process), "env" (the launcher's NEXUS_SERVING_*), "redis" (live registry).
    admission_share: str = "single"
    limits_backend: str = "local"  # or "redis"
    limits_redis_url: str = ""
    limits_fail_open: bool = True
    limits_redis_timeout: float = 0.5
    default_completion_tokens: int = 1024
    reconcile_interval: float = 30.0
    # The response cache's store: Redis if a URL is given, else memory.
    cache_redis_url: str = ""
    cache_redis_max_bytes: int = 256 * 1024**2
    cache_memory_max_bytes: int = 64 * 1024**2
    cache_redis_timeout: float = 0.25

    @classmethod
    def from_settings(cls) -> GatewayConfig:
        return cls(
            auth_required=settings.NEXUS_AUTH_REQUIRED,
            max_body_bytes=settings.NEXUS_MAX_BODY_BYTES,
            client_body_timeout=settings.NEXUS_CLIENT_BODY_TIMEOUT,
            max_blob_bytes=settings.NEXUS_MAX_BLOB_BYTES,
            blob_timeout=settings.NEXUS_BLOB_TIMEOUT,
            connect_timeout=settings.NEXUS_UPSTREAM_CONNECT_TIMEOUT,
            max_connections=settings.NEXUS_UPSTREAM_MAX_CONNECTIONS,
            max_reply_bytes=settings.NEXUS_UPSTREAM_MAX_REPLY_BYTES,
            max_event_bytes=settings.NEXUS_UPSTREAM_MAX_EVENT_BYTES,
            max_unsent_bytes=settings.NEXUS_STREAM_MAX_UNSENT_BYTES,
            stall_seconds=settings.NEXUS_STREAM_STALL_SECONDS,
            max_streams_per_key=settings.NEXUS_KEY_MAX_STREAMS,
            config_poll_interval=settings.NEXUS_CONFIG_POLL_INTERVAL,
            usage_buffer_max=settings.NEXUS_USAGE_BUFFER_MAX,
            usage_transport=settings.NEXUS_USAGE_TRANSPORT,
            usage_progress_interval=settings.NEXUS_USAGE_PROGRESS_INTERVAL,
            access_log=settings.NEXUS_ACCESS_LOG,
            drain_seconds=settings.NEXUS_DRAIN_SECONDS,
            metrics_allow=tuple(settings.NEXUS_METRICS_ALLOW),
            metrics_token=settings.NEXUS_METRICS_TOKEN,
            metrics_per_key=settings.NEXUS_METRICS_PER_KEY,
            breaker=BreakerSettings.from_settings(),
            error_cache_seconds=settings.NEXUS_ERROR_CACHE_SECONDS,
            admission_share="redis" if settings.REDIS_URL else "env",
            limits_backend=settings.NEXUS_LIMITS_BACKEND,
            limits_redis_url=settings.NEXUS_LIMITS_REDIS_URL,
            limits_fail_open=settings.NEXUS_LIMITS_ON_REDIS_ERROR == "open",
            limits_redis_timeout=settings.NEXUS_LIMITS_REDIS_TIMEOUT,
            default_completion_tokens=settings.NEXUS_LIMITS_DEFAULT_COMPLETION_TOKENS,
            reconcile_interval=settings.NEXUS_LIMITS_RECONCILE_INTERVAL,
            cache_redis_url=settings.NEXUS_CACHE_REDIS_URL,
            cache_redis_max_bytes=settings.NEXUS_CACHE_REDIS_MAX_BYTES,
            cache_memory_max_bytes=settings.NEXUS_CACHE_MEMORY_MAX_BYTES,
            cache_redis_timeout=settings.NEXUS_CACHE_REDIS_TIMEOUT,
        )


def _make_sink(config: GatewayConfig, buffer: UsageBuffer) -> UsageSink:
    # During an outage, what is over a tenth of the buffer's bound waits on disk.
    spill = UsageSpill(
        settings.NEXUS_USAGE_SPILL_DIR,
        keep_in_memory=max(100, config.usage_buffer_max // 10),
    )
    if config.usage_transport == "redis":
        from usage.stream import RedisShipper  # needs the redis package only here

        return RedisShipper(buffer, spill=spill)
    return DatabaseFlusher(buffer, spill=spill)


def _make_limiter(config: GatewayConfig, on_error: Callable[[], None]) -> Limiter:
    if config.limits_backend == "redis":
        from usage.limits.redis_limiter import RedisLimiter  # needs Redis only here

        return RedisLimiter(
            config.limits_redis_url,
            fail_open=config.limits_fail_open,
            timeout=config.limits_redis_timeout,
            on_error=on_error,
        )
    return LocalLimiter()


def _places_of(limiter: Limiter) -> Places:
    """Admission's queue places: counted where the limiter counts (Redis: the
    gateway as a whole)."""
    if isinstance(limiter, LocalLimiter):
        return LocalPlaces()
    from usage.limits.redis_limiter import RedisLimiter  # needs Redis only here

    return SharedPlaces(limiter) if isinstance(limiter, RedisLimiter) else LocalPlaces()


class Gateway:
    """The live state of one serving process (see the module docstring)."""

    def __init__(
        self,
        config: GatewayConfig | None = None,
        *,
        build: Callable[[], GatewayState] = build_state,
        read_version: Callable[[], int] = read_config_version,
        sink: Callable[[GatewayConfig, UsageBuffer], UsageSink] = _make_sink,
    ) -> None:
        self.config = config = config or GatewayConfig.from_settings()
        self.snapshots: SnapshotHolder[GatewayState] = SnapshotHolder(
            build,
            poll_interval=config.config_poll_interval,
            read_version=read_version,
        )
        self.router = Router()
        self.stats = LiveStats()
        # Which backend computed which prompt prefix, and sessions' backends.
        self.prefix = PrefixIndex()
        self.breaker = CircuitBreaker(stats=self.stats, config=config.breaker)
        self.error_cache = ErrorCache(
            stats=self.stats, seconds=config.error_cache_seconds
        )
        # Small-context limits learned from overflows (context shift's pre-trim).
        self.context_limits = SharedContextLimits()
        self.buffer = UsageBuffer(maxlen=config.usage_buffer_max)
        self.usage_sink = sink(config, self.buffer)
        self.open_requests = OpenRequests(self.buffer, config.usage_progress_interval)
        self.upstream = UpstreamClient(
            max_connections=config.max_connections,
            connect_timeout=config.connect_timeout,
            limits=ReplyLimits(
                max_reply=config.max_reply_bytes,
                max_event=config.max_event_bytes,
                max_unsent=config.max_unsent_bytes,
                stall_seconds=config.stall_seconds,
            ),
        )
        # A consumer in another process gets as long to take a request as a
        # worker gets to answer its pings (at least 5 s).
        self.relay = RelayHub(
            accept_timeout=max(
                protocol.MISSED_HEARTBEATS_BEFORE_GONE
                * settings.NEXUS_RELAY_HEARTBEAT_SECONDS,
                5.0,
            ),
            stats=self.stats,
            max_reply=config.max_reply_bytes,
            # Over the stream's own unsent bound the proxy stops reading the
            # call; the worker may run ahead of it by a few times that.
            max_unread=4 * config.max_unsent_bytes,
            state=self.snapshots.peek,
            heartbeats=HeartbeatClock(
                settings.NEXUS_RELAY_HEARTBEAT_SECONDS,
                settings.NEXUS_RELAY_HEARTBEATS_PER_SECOND,
            ),
        )
        # What each worker may cost this process (its consumers share it).
        self.relay_guard = RelayGuard()
        self.metrics = GatewayMetrics(per_key=config.metrics_per_key)
        # OpenTelemetry traces of the proxy's requests: None unless the OTEL_*
        # environment asks for them.
        self.tracing = Tracing.from_environment()
        self.limiter = _make_limiter(config, self.metrics.limiter_errors.inc)
        self.cache = ResponseCache.from_settings(
            self.metrics,
            config.cache_redis_url,
            config.cache_redis_max_bytes,
            config.cache_memory_max_bytes,
            config.cache_redis_timeout,
        )
        self.admission = AdmissionGate(
            self.metrics,
            share=config.admission_share,
            places=_places_of(self.limiter),
        )
        self.live_usage = LiveUsage(
            in_flight=lambda: self.stats.in_flight_by_model,
            admission=self.admission.snapshot,
            admission_changes=lambda: self.admission.controller.counts.events,
        )
        self.publisher = UsagePublisher(self.live_usage)
        self.fleet = FleetScheduler(
            self.stats,
            self.metrics,
            session=lambda: self.upstream.session,
            routes=self._current_routes,
            release_lease=self.limiter.release_backend,
            out_of_memory=self.error_cache.out_of_memory,
        )
        self.metrics_endpoint = MetricsEndpoint(
            self.metrics,
            self.refresh_gauges,
            parse_networks(config.metrics_allow),
            config.metrics_token,
        )
        self.breaker.on_open = self._count_opening
        self.snapshots.on_install = self._note_config
        # Requests the proxy is serving now; draining waits for zero.
        self.active = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.services: list[Service] = self._list_services()
        self._started: list[Service] = []

    # Lifecycle -------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._loop is not None

    def ensure_started(self) -> None:
        """Start on the running loop unless already running there (cheap)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop and not self.draining:
            self.start()

    def start(self) -> None:
        """Start every service, in order, on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._started = []
        start_in_order(self.services, self._started)

    @property
    def stop_seconds(self) -> float:
        """How long ``stop()`` may take: the drain period, within 5 to 8 s."""
        drain = self.config.drain_seconds
        return min(max(drain, STOP_SECONDS_MIN), STOP_SECONDS_MAX)

    async def stop(self) -> None:
        """Stop what started, in reverse, within ``stop_seconds``.

        The usage sink hands on the usage still held as it stops; a service
        whose stop overruns its share of the time is left behind (logged),
        so that one stuck service cannot hold the process's exit.
        """
        started, self._started = self._started, []
        await stop_in_reverse(started, self.stop_seconds)
        self._loop = None

    def _list_services(self) -> list[Service]:
        """The services in start order; they stop in reverse.

        The order of stopping is the point: the relay first (its workers
        reconnect elsewhere at once), then the listeners and periodic work,
        admission (letting through what still waits), the fleet, the
        snapshots, the publisher, the breaker's and the error cache's last
        announcements, the usage
        sink (handing on the usage still held, after the open requests'
        last progress), the response cache (its last stores), the limiter
        (writing its last settles), and the upstream client, which the
        others use, last.
        """
        services: list[Service] = [
            _UpstreamService(self.upstream),
            self.limiter,
            self.cache,
            self.usage_sink,
            self.open_requests,
            self.breaker,
            self.error_cache,
            self.publisher,
            self.snapshots,
            self.fleet,
            self.admission,
        ]
        if isinstance(self.limiter, LocalLimiter):
            services.append(self._reconciliation(self.limiter))
        if self.tracing is not None:
            services.insert(1, _TracingService(self.tracing))
        return [
            *services,
            # The breaker's openings and the error cache's failures.
            _listener(BREAKER_GROUP, self._on_backend_news, "breaker-listen"),
            _listener(
                CONTEXT_GROUP, self.context_limits.on_message, "context-limits-listen"
            ),
            _listener(USAGE_GROUP, self.publisher.on_message, "usage-listen"),
            periodic(
                "gauges",
                GAUGE_REFRESH_SECONDS,
                self.refresh_gauges,
                error="Could not update the gauges",
                log=logger.warning,
            ),
            _listener(LOAD_GROUP, self.relay.on_load_message, "relay-load-listen"),
            periodic(
                "relay-states",
                RELAY_STATE_WRITE_SECONDS,
                self._write_relay_states,
                error="Could not store relay workers' states",
                log=logger.warning,
            ),
            periodic(
                "relay-seen",
                lambda: settings.NEXUS_RELAY_SEEN_WRITE_SECONDS,
                self._write_relay_seen,
                error="Could not note relay workers' heartbeats",
                log=logger.warning,
            ),
            periodic(
                "relay-sweep",
                lambda: settings.NEXUS_RELAY_HEARTBEAT_SECONDS,
                self._sweep_workers,
                error="Could not sweep silent relay workers",
                log=logger.warning,
            ),
            self.relay,
        ]

    # Draining --------------------------------------------------------------

    def request_started(self) -> None:
        self.active += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self.active -= 1
        if self.active <= 0:
            self.active = 0
            self._idle.set()

    async def drain(self, grace: float | None = None) -> bool:
        """Refuse new requests and wait for those in flight; True if all ended."""
        self.draining = True
        timeout = self.config.drain_seconds if grace is None else grace
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            logger.warning(
                "%d requests still in flight after the %g s drain period",
                self.active,
                timeout,
            )
            return False
        return True

    # State shown elsewhere -------------------------------------------------

    def refresh_gauges(self) -> None:
        """Copy in-flight, health and buffer numbers into the metrics."""
        state = self.snapshots.peek()
        in_flight = dict(self.stats.in_flight_counts)
        names: list[tuple[str, bool]] = []
        if state is not None:
            for backend in state.routes.backends:
                is_up = (
                    backend.enabled
                    and backend.status == Health.HEALTHY
                    and not self.stats.is_circuit_open(backend.name)
                )
                names.append((backend.name, is_up))
        self.metrics.set_backends(in_flight, names)
        self.metrics.set_usage_buffer(len(self.buffer), self.buffer.dropped_total)
        self.admission.refresh_metrics()
        self.metrics.set_fleet_lines(self.fleet.queues.lines())

    async def _sweep_workers(self) -> None:
        """Make Gone the relay workers of a serving process that died.

        Every heartbeat, workers not seen for a liveness write period and 3
        heartbeats (at least 10 s) and not connected here are Gone
        (backends.workers.sweep_silent_workers): within that and a heartbeat
        of their process's death (50 s by default), rather than when their
        health result goes stale.
        """
        interval = settings.NEXUS_RELAY_HEARTBEAT_SECONDS
        await database_sync_to_async(sweep_silent_workers)(
            max(RELAY_SILENCE_HEARTBEATS * interval, RELAY_SILENCE_MIN_SECONDS)
            + settings.NEXUS_RELAY_SEEN_WRITE_SECONDS,
            list(self.relay.links),
        )

    async def _write_relay_states(self) -> None:
        """Store what relay workers' heartbeats reported that changed."""
        registry = self.relay.registry
        changes = registry.take_changes()
        if changes:
            try:
                await self.relay_guard.churn.run(record_worker_states, changes)
            except Exception:
                for worker_id in changes:  # written at the next round
                    registry.rewrite(worker_id)
                raise

    async def _write_relay_seen(self) -> None:
        """Note this process's relay workers' heartbeats in the database, all
        together; close those that may not stay (revoked, or connected
        elsewhere)."""
        registry = self.relay.registry
        self.relay.republish_loads()
        lost = await self.relay_guard.churn.run(see_workers, registry.channels())
        await registry.lose(lost)

    def _reconciliation(self, limiter: LocalLimiter) -> Service:
        """Raise this process's budget counters to the rolled-up spend (embedded)."""

        async def reconcile() -> None:
            limiter.reconcile(await database_sync_to_async(read_budget_spend)())

        return periodic(
            "reconcile",
            self.config.reconcile_interval,
            reconcile,
            error="Could not read the keys' spend",
            log=logger.warning,
        )

    def _on_backend_news(self, message: dict[str, Any]) -> None:
        """Another process opened a circuit or could not connect to a backend."""
        self.breaker.on_message(message)
        self.error_cache.on_message(message)

    def _count_opening(self, backend_name: str) -> None:
        self.metrics.breaker_openings.labels(backend_name).inc()

    def _current_routes(self) -> RouterSnapshot | None:
        state = self.snapshots.peek()
        return None if state is None else state.routes

    def _note_config(self, state: GatewayState) -> None:
        self.metrics.config_version.set(state.version)
        self.admission.state_installed(state)
        self.fleet.snapshot_installed()
        self.cache.note_policy(state.routes.policy.cache)
        if isinstance(self.limiter, LocalLimiter):
            self.limiter.reconcile(state.spend)


class _UpstreamService:
    """The upstream client as a service: its session lives from start to stop."""

    name = "upstream"

    def __init__(self, client: UpstreamClient) -> None:
        self.client = client

    def start(self) -> None:
        """Open the session on the running loop."""
        self.client.open()

    async def stop(self) -> None:
        """Close the session and its connections."""
        await self.client.close()


class _TracingService:
    """Traces as a service: what is still batched is exported as it stops."""

    name = "tracing"

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    def start(self) -> None:
        """Nothing to start: the batch processor's thread runs from the first span."""

    async def stop(self) -> None:
        """Export the last spans, off the loop, within a few seconds."""
        await asyncio.to_thread(self.tracing.flush, TRACES_FLUSH_SECONDS)


def _listener(
    group: str, handle: Callable[[dict[str, Any]], None], name: str
) -> TaskService:
    """A service passing every message of `group` to `handle`."""
    return TaskService(name, lambda: listen_to_group(group, handle))


def tune_garbage_collector() -> None:
    """Move start-up objects out of the collector's way and collect less often.

    Everything alive after start-up (modules, settings, the first snapshot)
    would otherwise be traversed by every full collection: ``gc.freeze()``
    moves it to a permanent generation. Per-request objects are freed by
    reference counting; the raised thresholds only make the rare cyclic
    collections less frequent, which removes the loop stalls behind the tail
    latency.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


_current: Gateway | None = None
# Sync views ask for the gateway from asgiref's thread pool: two threads must
# not both build one on first use.
_current_lock = threading.Lock()


def install_gateway(gateway: Gateway) -> None:
    """Make `gateway` the one this process serves with (the ASGI wiring).

    Raises ``RuntimeError`` if the process has another gateway already (one
    built on first use, or installed before): one process serves with one
    gateway, and the views would otherwise show another's numbers.
    """
    global _current
    with _current_lock:
        if _current is not None and _current is not gateway:
            raise RuntimeError("This process has a gateway already")
        _current = gateway


def current_gateway() -> Gateway:
    """The gateway of this serving process (built on first use elsewhere)."""
    global _current
    gateway = _current
    if gateway is None:
        with _current_lock:
            if _current is None:
                _current = Gateway()
            gateway = _current
    return gateway
