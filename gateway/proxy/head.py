"""What the gateway can decide from a request's head alone, before its body.

A server that lets the application see the headers before the body (uvicorn,
granian) gets these answers from the proxy itself, which checks the key and
``Content-Length`` before it reads a byte of the body. Daphne reads (and spools
to disk) the whole body first, so ``nexus_site.servers.daphne_limits`` asks
``refuse_head()`` at the moment Twisted has all the headers and answers there:
an upload without a valid key or over the limit costs its sender, not us.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.proxy.errors import ProxyError, unauthorized
from gateway.proxy.surfaces import COUNT_TOKENS_PATH, ENDPOINTS, OPENAI, Surface

# POST paths of the gateway that need a client key, with the surface whose
# error shape they answer in: every surface's inference endpoints.
KEYED_UPLOAD_PATHS: dict[str, Surface] = {
    **{path: surface for path, (_, surface) in ENDPOINTS.items()},
    COUNT_TOKENS_PATH: ENDPOINTS["/v1/messages"][1],
}


def surface_of(path: bytes) -> Surface:
    """The surface whose error shape an upload to `path` is answered in."""
    return KEYED_UPLOAD_PATHS.get(path.partition(b"?")[0].decode("latin-1"), OPENAI)


def find_key_prefix(keys: Mapping[str, str], authorization: bytes | None) -> str | None:
    """Return the visible prefix of the client key in `authorization`, or None.

    Keys are looked up by their SHA-256 digest: the stored secret is never
    compared byte by byte, so timing reveals nothing about it.
    """
    if not authorization:
        return None
    scheme, _, token = authorization.partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return keys.get(hashlib.sha256(token).hexdigest())


def too_large(limit: int) -> ProxyError:
    """The 413 for a body over the limit (in OpenAI's error shape)."""
    return ProxyError(
        413,
        f"The request body is larger than this gateway accepts ({limit} bytes).",
        code="request_too_large",
    )


def missing_key() -> ProxyError:
    """The 401 for an upload with no valid key, decided at the headers."""
    return unauthorized(
        "You didn't provide a valid API key. Send your Nexus key as "
        "'Authorization: Bearer <key>' (or 'x-api-key: <key>' on /v1/messages)."
    )


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the server read of a request before its body."""

    method: bytes
    path: bytes
    content_length: int | None
    authorization: bytes | None
    api_key: bytes | None


def refuse_head(
    head: RequestHead,
    keys: Mapping[str, str] | None,
    *,
    auth_required: bool,
    max_body: int,
) -> tuple[ProxyError, Surface] | None:
    """Return the error a request must get from its head alone, or None.

    With the error comes the surface whose shape it is answered in. `keys` is
    None while the serving process has no configuration yet (the proxy decides
    then). A key (``Authorization: Bearer``, or ``x-api-key`` where the
    surface takes it) is checked only on the gateway's keyed upload paths; the
    size on every path.
    """
    surface = KEYED_UPLOAD_PATHS.get(head.path.partition(b"?")[0].decode("latin-1"))
    if (
        surface is not None
        and auth_required
        and keys is not None
        and head.method == b"POST"
    ):
        authorization = head.authorization
        if head.api_key is not None and surface.accepts_x_api_key:
            authorization = b"Bearer " + head.api_key
        if find_key_prefix(keys, authorization) is None:
            return missing_key(), surface
    length = head.content_length
    if length is not None and length > max_body:
        return too_large(max_body), surface or OPENAI
    return None
