"""Health rounds: probe backends concurrently, then move each one's health state.

``check_all()`` probes every enabled backend at once (one ``httpx.AsyncClient``,
one timeout per probe), so a round lasts about as long as its slowest probe and
never longer than the probe timeout. The results then go through the state
machine in ``next_health()``:

- unknown -> healthy after one good probe;
- healthy (or unknown) -> unhealthy after N consecutive failed probes;
- unhealthy -> healthy after M consecutive good probes;
- draining is the operator's: probes keep the numbers current but never change
  the status;
- a backend that is loading its model (llama.cpp's 503) neither fails nor
  succeeds: its counters restart and its status stays.

Rounds may overlap (beat firing while a slow round runs, two workers, an admin
click): each backend row is locked while its new state is computed, and a probe
that started before the last recorded one finished is dropped, so one moment
of a backend's life is never counted twice and no update is lost.

After a good probe the round also reads each server's version (see
``backends.kinds``), with what is left of the probe's time and never more than
half of it, so that a slow or broken version endpoint cannot turn a good probe
into a timeout: a version that cannot be read keeps the one recorded before.
Versions are read here only, never on a request.

A good probe also records what the server said of its memory (Ollama's
/api/ps size_vram sum, llama.cpp's slots, vLLM's KV cache pressure:
``Backend.note_memory``), which the fleet strategy reads through the snapshot.

A status change is announced to the apps above (``announce_change()``; the
updates bypass model signals on purpose: a round that only refreshes latency
and check times must not make every serving process rebuild its snapshot), and
so is a memory change worth it (in use moving by half a gigabyte or more,
pressure, slots).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from typing import TypedDict

import httpx
from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from backends.kinds import (
    MAX_MESSAGE,
    BackendKindAdapter,
    Endpoint,
    ProbeFailed,
    ProbeResult,
    ProbeStatus,
    describe_error,
)
from backends.kinds.calls import Answer, call_backends
from backends.models import HEALTH_FIELDS, Backend, BackendModel, HealthStatus

logger = logging.getLogger(__name__)

# The version read gets at most this share of the probe timeout, and must end
# this share of it before the timeout (the probe's own answer is kept then).
VERSION_SHARE = 0.5
VERSION_MARGIN = 0.1
# Less time than this left: not worth asking.
MIN_VERSION_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class HealthState:
    """The health fields of one backend, as the state machine sees them."""

    status: HealthStatus
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    avg_latency_ms: float | None = None
    last_error: str = ""


@dataclass(frozen=True, slots=True)
class Thresholds:
    """How many failures make a backend unhealthy and successes bring it back."""

    failures: int = 3
    recoveries: int = 2
    latency_alpha: float = 0.3

    @classmethod
    def from_settings(cls) -> Thresholds:
        return cls(
            failures=settings.NEXUS_HEALTH_FAILURE_THRESHOLD,
            recoveries=settings.NEXUS_HEALTH_RECOVERY_THRESHOLD,
            latency_alpha=settings.NEXUS_HEALTH_LATENCY_ALPHA,
        )


@dataclass(frozen=True, slots=True)
class Observation:
    """One probe of one backend and when it ran (wall clock, for the database)."""

    result: ProbeResult
    started_at: datetime
    finished_at: datetime


class CheckReportDict(TypedDict):
    """One backend's check, as ``nexus_check_health --json`` prints it."""

    name: str
    kind: str
    status: str
    previous_status: str
    probe: str
    latency_ms: float | None
    avg_latency_ms: float | None
    models: int
    error: str
    superseded: bool
    # The server's version as recorded ("": unknown or a kind that does not say).
    version: str
    # "pending (1 of 2 successes)", "failing (1 of 3 failures)" or "".
    progress: str


class BackendHealthDict(TypedDict):
    """One backend's recorded health in JSON (the live usage stream's rows)."""

    name: str
    enabled: bool
    status: str
    avg_latency_ms: float | None
    last_check_at: str | None
    # Share of prompt tokens its prompt cache held, as the server counts (None:
    # it does not say).
    prefix_cache_hit_rate: float | None
    # The last result is older than 3 health intervals: routed as unknown.
    stale: bool
    last_error: str


@dataclass(frozen=True, slots=True)
class CheckReport:
    """What one check found and what the backend's state is now.

    ``superseded`` means an overlapping round recorded the same moment first;
    the state shown is then that round's.
    """

    backend_id: int
    name: str
    kind: str
    status: str
    previous_status: str
    probe: ProbeStatus
    latency_ms: float | None
    avg_latency_ms: float | None
    error: str
    models: int
    superseded: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    thresholds: Thresholds = Thresholds()
    version: str = ""

    @property
    def progress(self) -> str:
        """Where the state machine stands, when a status is about to change.

        "pending (1 of 2 successes)" for an unhealthy backend that answered,
        "failing (1 of 3 failures)" for a backend still counted healthy or
        unknown that did not; "" otherwise.
        """
        if self.status == HealthStatus.UNHEALTHY and self.consecutive_successes:
            return (
                f"pending ({self.consecutive_successes} of "
                f"{self.thresholds.recoveries} successes)"
            )
        if (
            self.status in (HealthStatus.HEALTHY, HealthStatus.UNKNOWN)
            and self.consecutive_failures
        ):
            return (
                f"failing ({self.consecutive_failures} of "
                f"{self.thresholds.failures} failures)"
            )
        return ""

    @property
    def status_changed(self) -> bool:
        return self.status != self.previous_status

    @property
    def recovered(self) -> bool:
        """True when this check made the backend healthy."""
        return self.status_changed and self.status == HealthStatus.HEALTHY

    def as_dict(self) -> CheckReportDict:
        return {
            "name": self.name,
            "kind": self.kind,
            "status": self.status,
            "previous_status": self.previous_status,
            "probe": str(self.probe),
            "latency_ms": _round(self.latency_ms),
            "avg_latency_ms": _round(self.avg_latency_ms),
            "models": self.models,
            "error": self.error,
            "superseded": self.superseded,
            "version": self.version,
            "progress": self.progress,
        }


def read_backend_health() -> list[BackendHealthDict]:
    """Read every backend's recorded health, by name (sync code only)."""
    now = timezone.now()
    backends = Backend.objects.order_by("name").only(
        "name",
        "enabled",
        "status",
        "avg_latency_ms",
        "last_check_at",
        "last_error",
        "prefix_cache_hits",
        "prefix_cache_queries",
    )
    return [
        {
            "name": backend.name,
            "enabled": backend.enabled,
            "status": backend.status,
            "avg_latency_ms": backend.avg_latency_ms,
            "prefix_cache_hit_rate": backend.prefix_cache_hit_rate,
            "last_check_at": (
                backend.last_check_at.isoformat() if backend.last_check_at else None
            ),
            "stale": backend.is_health_stale(now),
            "last_error": backend.last_error[:200],
        }
        for backend in backends
    ]


def next_health(
    state: HealthState, result: ProbeResult, thresholds: Thresholds
) -> HealthState:
    """Return the state after one probe (the state machine; no I/O)."""
    status = state.status
    if result.status is ProbeStatus.LOADING:
        return replace(
            state,
            consecutive_failures=0,
            consecutive_successes=0,
            last_error=result.error,
        )
    if result.status is ProbeStatus.UP:
        successes = state.consecutive_successes + 1
        if status == HealthStatus.UNKNOWN or (
            status == HealthStatus.UNHEALTHY and successes >= thresholds.recoveries
        ):
            status = HealthStatus.HEALTHY
        return HealthState(
            status=status,
            consecutive_failures=0,
            consecutive_successes=successes,
            avg_latency_ms=_fold_latency(
                state.avg_latency_ms, result.latency_ms, thresholds.latency_alpha
            ),
            last_error="",
        )
    failures = state.consecutive_failures + 1
    if (
        status in (HealthStatus.HEALTHY, HealthStatus.UNKNOWN)
        and failures >= thresholds.failures
    ):
        status = HealthStatus.UNHEALTHY
    return replace(
        state,
        status=status,
        consecutive_failures=failures,
        consecutive_successes=0,
        last_error=result.error,
    )


def check_all(
    backend_ids: Iterable[int] | None = None, *, include_disabled: bool = False
) -> list[CheckReport]:
    """Probe backends concurrently and record what was found (sync code only).

    Without ``backend_ids`` every enabled backend is checked; disabled ones are
    checked only when named and ``include_disabled`` is set. Reports come back
    in the backends' admin order.
    """
    endpoints = Backend.objects.endpoints(
        backend_ids, include_disabled=include_disabled
    )
    if not endpoints:
        return []
    timeout = settings.NEXUS_HEALTH_PROBE_TIMEOUT
    answers = asyncio.run(
        call_backends(
            endpoints,
            partial(_probe, timeout=timeout),
            timeout=timeout,
            connections_per_backend=2,
            keep_alive=False,
            action="Probing",
        )
    )
    observations = {pk: _observe(answer) for pk, answer in answers.items()}
    return _record(observations, {pk: e.api_key for pk, e in endpoints.items()})


def check_backend(backend_id: int) -> CheckReport:
    """Probe one backend now (even a disabled one) and record the result."""
    reports = check_all([backend_id], include_disabled=True)
    if not reports:
        raise Backend.DoesNotExist(f"No backend with id {backend_id}")
    return reports[0]


async def _probe(
    adapter: BackendKindAdapter,
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    *,
    timeout: float,
) -> ProbeResult:
    started = time.perf_counter()
    result = await adapter.probe(client, endpoint)
    if result.status is ProbeStatus.DOWN or result.version is not None:
        return result  # down, or the probe read the version already
    # The round's timeout covers the probe and the version together: the
    # version gets what the probe left, with a margin, and at most half.
    left = min(
        timeout * VERSION_SHARE,
        timeout * (1 - VERSION_MARGIN) - (time.perf_counter() - started),
    )
    version = await _read_version(adapter, client, endpoint, left)
    return replace(result, version=version)


async def _read_version(
    adapter: BackendKindAdapter,
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    seconds: float,
) -> str | None:
    """The server's version, or None when it could not be read in `seconds`."""
    if seconds <= MIN_VERSION_SECONDS:
        return None
    try:
        async with asyncio.timeout(seconds):
            return await adapter.read_version(client, endpoint)
    except (TimeoutError, httpx.HTTPError, ProbeFailed) as failure:
        logger.debug(
            "Could not read the version of %s: %s",
            endpoint.name,
            describe_error(failure, timeout=seconds),
        )
    except Exception:
        logger.warning("Reading the version of %s failed", endpoint.name, exc_info=True)
    return None


def _observe(answer: Answer[ProbeResult]) -> Observation:
    result = answer.value
    if result is None:
        result = ProbeResult(ProbeStatus.DOWN, error=answer.error)
    return Observation(result, answer.started_at, answer.finished_at)


def _record(
    observations: dict[int, Observation], api_keys: dict[int, str]
) -> list[CheckReport]:
    thresholds = Thresholds.from_settings()
    reports: list[CheckReport] = []
    versions_changed: list[tuple[str, str, str]] = []
    changed = False
    with transaction.atomic():
        # Locked in primary-key order, so overlapping rounds cannot deadlock.
        rows = list(
            Backend.objects.select_for_update()
            .filter(pk__in=list(observations))
            .order_by("pk")
        )
        model_counts = _count_models(observations)
        updated: list[Backend] = []
        for row in rows:
            observation = observations[row.pk]
            result = observation.result
            previous = str(row.status)
            superseded = (
                row.last_check_at is not None
                and row.last_check_at >= observation.started_at
            )
            if not superseded:
                state = next_health(_state_of(row), result, thresholds)
                row.status = state.status
                row.consecutive_failures = state.consecutive_failures
                row.consecutive_successes = state.consecutive_successes
                row.avg_latency_ms = state.avg_latency_ms
                row.last_error = redact_error(
                    state.last_error, api_keys.get(row.pk, "")
                )
                row.last_check_at = observation.finished_at
                if result.version is not None:
                    if row.server_version and result.version != row.server_version:
                        versions_changed.append(
                            (row.name, row.server_version, result.version)
                        )
                    row.server_version = result.version
                if result.memory is not None:
                    changed |= row.note_memory(result.memory, observation.finished_at)
                if result.prefix_cache is not None:
                    changed |= row.note_prefix_cache(result.prefix_cache)
                updated.append(row)
                changed |= row.status != previous
                if result.loaded_models is not None:
                    changed |= BackendModel.objects.filter(
                        backend_id=row.pk
                    ).set_loaded(result.loaded_models, result.loaded_details)
            reports.append(
                CheckReport(
                    backend_id=row.pk,
                    name=row.name,
                    kind=row.kind,
                    status=str(row.status),
                    previous_status=previous,
                    probe=result.status,
                    latency_ms=result.latency_ms,
                    avg_latency_ms=row.avg_latency_ms,
                    error=row.last_error,
                    models=model_counts.get(row.pk, 0),
                    superseded=superseded,
                    consecutive_failures=row.consecutive_failures,
                    consecutive_successes=row.consecutive_successes,
                    thresholds=thresholds,
                    version=row.server_version,
                )
            )
        Backend.objects.bulk_update(updated, HEALTH_FIELDS)
        if changed:
            Backend.objects.announce_change()
    for report in reports:
        if report.status_changed:
            logger.info(
                "Backend %s is now %s (was %s)%s",
                report.name,
                report.status,
                report.previous_status,
                f": {report.error}" if report.error else "",
            )
    for name, before, now in versions_changed:
        logger.info("Backend %s runs version %s now (was %s)", name, now or "?", before)
    order = {pk: index for index, pk in enumerate(observations)}
    return sorted(reports, key=lambda report: order[report.backend_id])


def _state_of(row: Backend) -> HealthState:
    return HealthState(
        status=HealthStatus(row.status),
        consecutive_failures=row.consecutive_failures,
        consecutive_successes=row.consecutive_successes,
        avg_latency_ms=row.avg_latency_ms,
        last_error=row.last_error,
    )


def _count_models(observations: dict[int, Observation]) -> dict[int, int]:
    rows = (
        BackendModel.objects.filter(backend_id__in=list(observations), enabled=True)
        .values("backend_id")
        .annotate(count=Count("id"))
        .values_list("backend_id", "count")
    )
    return dict(rows)


def _fold_latency(
    average: float | None, latest: float | None, alpha: float
) -> float | None:
    if latest is None:
        return average
    if average is None:
        return latest
    return average + alpha * (latest - average)


def redact_error(text: str, api_key: str) -> str:
    """Return an error text cut short and without the backend's key in it."""
    if api_key and len(api_key) >= 4:
        text = text.replace(api_key, "***")
    return text[:MAX_MESSAGE]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def record_breaker_opening(backend_name: str, detail: str) -> bool:
    """Mark a backend unhealthy because a gateway process's circuit opened.

    Health probes bring it back (M good probes). Draining and already unhealthy
    backends are left as they are. Returns whether the status changed.
    """
    with transaction.atomic():
        row = Backend.objects.select_for_update().filter(name=backend_name).first()
        if row is None or row.status in (
            HealthStatus.UNHEALTHY,
            HealthStatus.DRAINING,
        ):
            return False
        Backend.objects.filter(pk=row.pk).update(
            status=HealthStatus.UNHEALTHY,
            consecutive_successes=0,
            last_error=redact_error(f"circuit breaker opened: {detail}", row.api_key),
        )
        Backend.objects.announce_change()
    logger.info("Backend %s is now unhealthy (circuit breaker)", backend_name)
    return True
