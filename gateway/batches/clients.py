"""Who calls the batch surfaces, and their errors in each API's shape."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from usage.batches.jobs import BatchRequestError
from usage.models import ApiKey, hash_key

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def owner_of(request: HttpRequest) -> str:
    """The caller's key prefix ("" with client auth off and no key).

    Raises BatchRequestError(401) for a missing, unknown or expired key.
    """
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    token = token or request.headers.get("X-Api-Key", "").strip()
    if token:
        key = ApiKey.objects.active().filter(hashed_key=hash_key(token)).first()
        if key is not None and not key.is_expired(timezone.now()):
            return key.prefix
        if settings.NEXUS_AUTH_REQUIRED:
            raise BatchRequestError(
                401,
                f"Incorrect API key provided: {token[:6]}….",
                code="invalid_api_key",
            )
    elif settings.NEXUS_AUTH_REQUIRED:
        raise BatchRequestError(
            401, "You didn't provide an API key.", code="invalid_api_key"
        )
    return ""


def json_body(request: HttpRequest) -> Any:
    """The request's JSON body (read from the stream: it may be large)."""
    try:
        return json.load(request)
    except (ValueError, UnicodeDecodeError):
        raise BatchRequestError(
            400, "The request body is not valid JSON.", code="invalid_json"
        ) from None


def openai_error(error: BatchRequestError) -> HttpResponse:
    kind = "invalid_request_error"
    if error.status == 401:
        kind = "authentication_error"
    elif error.status >= 500:
        kind = "server_error"
    body = {
        "error": {
            "message": error.message,
            "type": kind,
            "param": error.param,
            "code": error.code,
        }
    }
    return JsonResponse(body, status=error.status)


def anthropic_error(error: BatchRequestError) -> HttpResponse:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": error.message}}
    return JsonResponse(body, status=error.status)
