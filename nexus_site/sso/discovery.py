"""The OpenID provider's endpoints, from its discovery document."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import httpx
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

logger = logging.getLogger(__name__)

# How long the document is kept; a failed fetch is retried after a minute.
KEEP_SECONDS = 3600.0
RETRY_SECONDS = 60.0
MAX_BYTES = 256 * 1024
# Setting name (mozilla-django-oidc's) -> the discovery document's field.
ENDPOINTS = {
    "OIDC_OP_AUTHORIZATION_ENDPOINT": "authorization_endpoint",
    "OIDC_OP_TOKEN_ENDPOINT": "token_endpoint",
    "OIDC_OP_USER_ENDPOINT": "userinfo_endpoint",
    "OIDC_OP_JWKS_ENDPOINT": "jwks_uri",
    "OIDC_OP_LOGOUT_ENDPOINT": "end_session_endpoint",
}


class DiscoveryError(ImproperlyConfigured):
    """The provider's discovery document could not be read."""


_lock = threading.Lock()
_document: dict[str, Any] | None = None
_fetched_at = 0.0
_failed_at = 0.0


def discovery_url() -> str:
    """The document's URL: the setting as given, or the issuer's well-known one."""
    url: str = settings.NEXUS_OIDC_DISCOVERY_URL
    if url and ".well-known/" not in url:
        url = url.rstrip("/") + "/.well-known/openid-configuration"
    return url


def endpoint(setting: str) -> str | None:
    """The provider's endpoint for a mozilla-django-oidc setting name."""
    document = read_document()
    value = document.get(ENDPOINTS[setting])
    return value if isinstance(value, str) and value else None


def read_document() -> dict[str, Any]:
    """The discovery document, fetched when missing or older than an hour.

    Raises DiscoveryError when it cannot be had (and asks again only after
    RETRY_SECONDS, so a provider outage costs no timeout per login).
    """
    global _document, _fetched_at, _failed_at
    now = time.monotonic()
    with _lock:
        if _document is not None and now - _fetched_at < KEEP_SECONDS:
            return _document
        if _failed_at and now - _failed_at < RETRY_SECONDS and _document is None:
            raise DiscoveryError("The OpenID provider could not be reached.")
        try:
            document = _fetch(discovery_url())
        except (httpx.HTTPError, ValueError) as error:
            _failed_at = now
            logger.error(
                "Cannot read the OpenID provider's discovery document: %s", error
            )
            if _document is not None:
                return _document  # keep serving logins with the last one
            raise DiscoveryError("The OpenID provider could not be reached.") from error
        _document, _fetched_at, _failed_at = document, now, 0.0
        return document


def _fetch(url: str) -> dict[str, Any]:
    timeout = settings.NEXUS_OIDC_TIMEOUT
    with (
        httpx.Client(timeout=timeout, follow_redirects=True) as client,
        client.stream("GET", url) as response,
    ):
        response.raise_for_status()
        body = b""
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > MAX_BYTES:
                raise ValueError("the discovery document is too large")
    document = json.loads(body)
    if not isinstance(document, dict):
        raise ValueError("the discovery document is not a JSON object")  # noqa: TRY004
    missing = [
        f
        for f in ("authorization_endpoint", "token_endpoint", "jwks_uri")
        if not isinstance(document.get(f), str)
    ]
    if missing:
        raise ValueError(f"the discovery document has no {', '.join(missing)}")
    return document


def forget_document() -> None:
    """Drop the kept document (tests; a provider that moved its endpoints)."""
    global _document, _fetched_at, _failed_at
    with _lock:
        _document, _fetched_at, _failed_at = None, 0.0, 0.0
