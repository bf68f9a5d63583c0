"""The management API's front door: its index, URL forms and error shape.

Everything under ``/api/`` answers JSON, with DRF's ``{"detail": ...}`` shape,
including Django's own 400/403/404/500 pages; and ``/api/v1/x`` and
``/api/v1/x/`` name the same endpoint, because scripts write both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import Resolver404, resolve, reverse
from django.views import defaults
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from nexus_lib.permissions import AnyStaffPermission

logger = logging.getLogger(__name__)

API_PREFIX = "/api/"

# name in the index -> URL name (see the apps' api/urls.py).
INDEX = {
    "backends": "backend-list",
    "backend_models": "backend-model-list",
    "aliases": "alias-list",
    "fallback_chains": "fallback-chain-list",
    "policy": "routing-policy",
    "config": "effective-config",
    "config_import": "config-import",
    "config_export": "config-export",
    "config_versions": "config-version-list",
    "cache": "cache",
    "cache_purge": "cache-purge",
    "route_explain": "route-explain",
    "keys": "api-key-list",
    "teams": "team-list",
    "usage_tokens": "usage-tokens",
    "usage_stats": "usage-stats",
    "usage_live": "usage-live",
    "schema": "api-schema",
    "docs": "api-docs",
}


class ApiIndexView(APIView):
    """Every endpoint of the management API, by name, as absolute URLs."""

    permission_classes = (AnyStaffPermission,)

    pagination_class = None

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response(
            {
                name: request.build_absolute_uri(reverse(url_name))
                for name, url_name in INDEX.items()
            }
        )


def _resolves(path: str) -> bool:
    try:
        resolve(path)
    except Resolver404:
        return False
    return True


class ApiSlashMiddleware:
    """Serve ``/api/...`` with or without a trailing slash, without a redirect.

    A redirect would lose a POST's body (and CommonMiddleware cannot redirect
    a POST at all); the other spelling is served in place instead.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        path = request.path_info
        if path.startswith(API_PREFIX) and path != API_PREFIX and not _resolves(path):
            other = path[:-1] if path.endswith("/") else f"{path}/"
            if _resolves(other):
                request.path_info = other
                request.path = f"{request.META.get('SCRIPT_NAME', '')}{other}"
        return self.get_response(request)


def _is_api(request: HttpRequest) -> bool:
    return request.path_info.startswith(API_PREFIX)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _is_api(request):
        return JsonResponse({"detail": "Bad request."}, status=400)
    return defaults.bad_request(request, exception)


def permission_denied(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _is_api(request):
        return JsonResponse(
            {"detail": "You do not have permission to perform this action."},
            status=403,
        )
    return defaults.permission_denied(request, exception)


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _is_api(request):
        return JsonResponse(
            {
                "detail": f"Not found: no endpoint at {request.path_info}. "
                f"GET {reverse('api-index')} lists them."
            },
            status=404,
        )
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if _is_api(request):
        return JsonResponse(
            {"detail": "Internal server error; the server's log has the details."},
            status=500,
        )
    return defaults.server_error(request)
