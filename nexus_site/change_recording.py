"""Each admin or API request that changes the configuration makes one version.

``ConfigHistoryMiddleware`` runs every unsafe request to the admin or the
management API in one transaction that records its configuration changes as
one version of the history (routing/history/recording.py), attributed to the
request's user, or to the user's admin token when the API authenticated one.
A request that fails with a 5xx changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import InterfaceError, OperationalError, transaction
from django.http import HttpRequest, HttpResponse

from nexus_lib.authorship import VIA_ADMIN, VIA_API, ChangeAuthor
from nexus_site.api import API_PREFIX
from nexus_site.middleware import database_error_response
from routing.history.recording import recording_changes

ADMIN_PREFIX = "/admin/"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


class ConfigHistoryMiddleware:
    """Record an admin or API request's configuration changes as one version."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        path = request.path_info
        if request.method in _SAFE_METHODS or not path.startswith(
            (ADMIN_PREFIX, API_PREFIX)
        ):
            return self.get_response(request)
        via = VIA_API if path.startswith(API_PREFIX) else VIA_ADMIN
        try:
            with recording_changes(lambda: request_author(request, via)):
                response = self.get_response(request)
                if response.status_code >= 500:
                    transaction.set_rollback(True)
        except (OperationalError, InterfaceError) as error:
            # Taking the lock or committing failed (the view's own errors
            # reached DatabaseOutageMiddleware already).
            answer = database_error_response(request, error)
            if answer is None:
                raise
            return answer
        return response


def request_author(request: HttpRequest, via: str) -> ChangeAuthor:
    """Who made the request: the user, or the user's admin token."""
    user = getattr(request, "user", None)
    name = (
        user.get_username()
        if user is not None and user.is_authenticated
        else "anonymous"
    )
    # DRF sets `auth` on the request it wraps: the admin token it accepted.
    if getattr(request, "auth", None) is not None:
        name = f"{name} (admin token)"
    return ChangeAuthor(name, via)
