"""Django pages during a database outage: a clear 503 instead of a bare 500.

The gateway (/v1) never touches the database on a request and keeps serving
from its last configuration; the admin, the dashboard and the management API
cannot. ``DatabaseOutageMiddleware`` turns the connection errors their views
raise into a 503: an HTML page saying so (it reloads itself every 10 s) or,
under /api/, a JSON error. Django reconnects on the next request once the
database answers again (``CONN_HEALTH_CHECKS``), so the pages come back by
themselves.
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


class DatabaseOutageMiddleware:
    """Answer 503 when a view fails because the database cannot be reached."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(
        self, request: HttpRequest, exception: Exception
    ) -> HttpResponse | None:
        if not isinstance(exception, OperationalError | InterfaceError):
            return None
        logger.warning(
            "Database unreachable while serving %s: %s", request.path, exception
        )
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
