"""Django pages during a database outage: a clear 503 instead of a bare 500.

The gateway (/v1) never touches the database on a request and keeps serving
from its last configuration; the admin, the dashboard and the management API
cannot. ``DatabaseOutageMiddleware`` turns the connection errors their views
raise into a 503: an HTML page saying so (it reloads itself every 10 s) or,
under /api/, a JSON error. Django reconnects on the next request once the
database answers again (``CONN_HEALTH_CHECKS``), so the pages come back by
themselves.

A conflict is not an outage: a deadlock, a serialization failure or a lock
wait that timed out (PostgreSQL), or SQLite's "database is locked", answers
503 with its own message and a short Retry-After, so nobody goes looking for
a database that is up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template import loader

logger = logging.getLogger(__name__)

OUTAGE_MESSAGE = (
    "The configuration database is unreachable; the gateway keeps serving from "
    "its last configuration."
)
RETRY_AFTER = "10"
BUSY_MESSAGE = (
    "The configuration database was busy with a conflicting change; "
    "nothing was saved. Retry the request."
)
BUSY_RETRY_AFTER = "1"
# SQLSTATEs of a transaction that lost a conflict: class 40 (serialization
# failure, deadlock) and lock_not_available (a lock wait that timed out).
_BUSY_SQLSTATE_PREFIXES = ("40", "55P03")


class DatabaseOutageMiddleware:
    """Answer 503 when a view fails because the database cannot be reached
    (or, briefly, because its change lost a conflict)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(
        self, request: HttpRequest, exception: Exception
    ) -> HttpResponse | None:
        return database_error_response(request, exception)


def database_error_response(
    request: HttpRequest, exception: Exception
) -> HttpResponse | None:
    """The 503 for a database error (outage or lost conflict); None for others."""
    if not isinstance(exception, OperationalError | InterfaceError):
        return None
    if is_conflict(exception):
        return _busy(request, exception)
    logger.warning("Database unreachable while serving %s: %s", request.path, exception)
    response: HttpResponse
    if request.path.startswith("/api/"):
        response = JsonResponse(
            {"detail": OUTAGE_MESSAGE, "code": "database_unreachable"}, status=503
        )
    else:
        # Rendered without the request: context processors would query
        # the database (the user, messages) and fail again.
        response = HttpResponse(
            loader.render_to_string("503_database.html"), status=503
        )
    response["Retry-After"] = RETRY_AFTER
    response["Cache-Control"] = "no-store"
    return response


def is_conflict(exception: Exception) -> bool:
    """Whether a database error is a lost conflict (retry), not an outage."""
    cause = exception.__cause__ or exception
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if isinstance(sqlstate, str):
        return sqlstate.startswith(_BUSY_SQLSTATE_PREFIXES)
    return "database is locked" in str(exception)


def _busy(request: HttpRequest, exception: Exception) -> HttpResponse:
    logger.warning(
        "Database conflict while serving %s (answered 503, retry): %s",
        request.path,
        exception,
    )
    response: HttpResponse
    if request.path.startswith("/api/"):
        response = JsonResponse(
            {"detail": BUSY_MESSAGE, "code": "database_busy"}, status=503
        )
    else:
        response = HttpResponse(
            loader.render_to_string("503_database_busy.html"), status=503
        )
    response["Retry-After"] = BUSY_RETRY_AFTER
    response["Cache-Control"] = "no-store"
    return response
