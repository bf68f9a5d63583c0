"""GET /health: whether Nexus can serve, with every backend's health."""

from __future__ import annotations

from typing import TypedDict
from urllib.parse import urlsplit, urlunsplit

from django.db import DatabaseError
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed

from backends.health import redact_error
from backends.models import Backend, HealthStatus
from gateway.process import current_gateway


class BackendHealthRowDict(TypedDict):
    """One backend as GET /health shows it to staff."""

    name: str
    kind: str
    url: str
    enabled: bool
    status: str
    # What the server said it runs on the last health round; None: unknown, or a
    # kind that does not say (OpenAI-compatible, Anthropic, relay).
    version: str | None
    circuit_open: bool
    # A connection to it failed moments ago: skipped for new requests here.
    error_cached: bool
    latency_ms: float | None
    last_check_at: str | None
    # The last result is older than 3 health intervals: treated as unknown.
    stale: bool
    last_error: str
    models: int


class HealthSummaryDict(TypedDict):
    total: int
    healthy: int
    unhealthy: int
    draining: int
    unknown: int
    disabled: int
    stale: int


class HealthDict(TypedDict, total=False):
    status: str  # "ok", "degraded" or "unavailable"
    database: str  # "ok" or "unreachable"
    summary: HealthSummaryDict
    hint: str  # what to do, when nothing serves
    backends: list[BackendHealthRowDict]  # staff only


NO_BACKEND = (
    "No backend is configured: add one in the admin (/admin/backends/backend/add/), "
    "through the API (POST /api/v1/backends) or a configuration file "
    "(manage.py nexus_import_config), or start with the demo backends "
    "(NEXUS_DEMO=1)."
)
NONE_SERVING = (
    "No enabled backend is healthy: the admin's backend list shows each one's "
    "last error; manage.py nexus_check_health checks them now."
)
DATABASE_DOWN = (
    "the configuration database is unreachable; the gateway keeps serving from "
    "its last configuration"
)


@never_cache
@require_safe
def health(request: HttpRequest) -> JsonResponse:
    """Answer 200 while some enabled backend is healthy, else 503.

    Open to anyone, like any load balancer check, with the overall status and
    the counts by health. Staff (a session or an admin token) also get each
    backend: name, kind, status, server version and the server part of its
    URL, never keys or URL credentials. A healthy backend whose last check is
    stale counts as unknown, as the router treats it.

    Versions are for staff only: a model server's version says which of its
    published vulnerabilities are still open (Ollama has had path traversal
    and remote code execution fixed in point releases), and names and URLs map
    the private network behind the gateway. A load balancer needs the status
    code; the anonymous body stays counts only.
    """
    try:
        backends = list(Backend.objects.with_model_count().order_by("priority", "name"))
    except DatabaseError:
        return _health_without_database()
    summary: HealthSummaryDict = {
        "total": len(backends),
        "healthy": 0,
        "unhealthy": 0,
        "draining": 0,
        "unknown": 0,
        "disabled": 0,
        "stale": 0,
    }
    rows: list[BackendHealthRowDict] = []
    serving = 0
    gateway = current_gateway()
    breaker, error_cache = gateway.breaker, gateway.error_cache
    now = timezone.now()
    for backend in backends:
        circuit_open = breaker.is_open(backend.name)
        stale = backend.is_health_stale(now)
        if not backend.enabled:
            summary["disabled"] += 1
        elif stale:
            summary["unknown"] += 1
            summary["stale"] += 1
        else:
            summary[HealthStatus(backend.status).value] += 1
            if backend.status == HealthStatus.HEALTHY and not circuit_open:
                serving += 1
        rows.append(
            {
                "name": backend.name,
                "kind": backend.kind,
                "url": _public_url(backend.base_url),
                "enabled": backend.enabled,
                "status": backend.status,
                "version": backend.server_version or None,
                "circuit_open": circuit_open,
                "error_cached": error_cache.is_cached(backend.name),
                "latency_ms": (
                    None
                    if backend.avg_latency_ms is None
                    else round(backend.avg_latency_ms, 1)
                ),
                "last_check_at": (
                    backend.last_check_at.isoformat() if backend.last_check_at else None
                ),
                "stale": stale,
                "last_error": redact_error(backend.last_error, backend.api_key),
                "models": backend.model_count,  # type: ignore[attr-defined]
            }
        )
    if not serving:
        status = "unavailable"
    elif serving < summary["total"] - summary["disabled"]:
        status = "degraded"
    else:
        status = "ok"
    body: HealthDict = {"status": status, "database": "ok", "summary": summary}
    if not serving:
        body["hint"] = NO_BACKEND if not backends else NONE_SERVING
    if _is_staff(request):
        body["backends"] = rows
    response = JsonResponse(body, status=200 if serving else 503)
    if not serving:
        # A state, answered to every probe, not a server error: Django would
        # log each as "Service Unavailable: /health" at ERROR.
        response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def _is_staff(request: HttpRequest) -> bool:
    """A staff session, or a staff user's management API token."""
    # No session (nor user) in a gateway-only process (NEXUS_ROLE=gateway).
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_staff:
        return True
    try:
        found = TokenAuthentication().authenticate(request)  # type: ignore[arg-type]
    except AuthenticationFailed:
        return False
    return found is not None and bool(found[0].is_staff)


def _health_without_database() -> JsonResponse:
    """What this serving process still routes with while the database is down.

    The gateway serves from its last snapshot, so a load balancer should keep
    sending traffic: 200 while the snapshot has a healthy backend, and the
    outage said in ``database`` and ``error``.
    """
    state = current_gateway().snapshots.peek()
    breaker = current_gateway().breaker
    serving = 0
    if state is not None:
        for backend in state.routes.backends:
            if (
                backend.enabled
                and backend.status == HealthStatus.HEALTHY
                and not breaker.is_open(backend.name)
            ):
                serving += 1
    return JsonResponse(
        {
            "status": "degraded" if serving else "unavailable",
            "database": "unreachable",
            "error": DATABASE_DOWN,
            "serving_backends": serving,
        },
        status=200 if serving else 503,
    )


def _public_url(url: str) -> str:
    """Scheme, host and port only: no credentials, path or query."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port else host
    return urlunsplit((parts.scheme, netloc, "", "", ""))
