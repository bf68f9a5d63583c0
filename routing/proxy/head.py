"""What the gateway can decide from a request's head alone, before its body.

A server that lets the application see the headers before the body (uvicorn,
granian) gets these answers from the proxy itself, which checks the key and
``Content-Length`` before it reads a byte of the body. Daphne reads (and spools
to disk) the whole body first, so ``nexus_site.daphne_limits`` asks
``refuse_head()`` at the moment Twisted has all the headers and answers there:
an upload without a valid key or over the limit costs its sender, not us.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from routing.proxy.errors import ProxyError, unauthorized

# POST paths of the gateway that need a client key (the proxy's inference
# endpoints; each surface added to the proxy adds its paths here).
KEYED_UPLOAD_PATHS = frozenset(
    ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
)


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
        "'Authorization: Bearer <key>'."
    )


def refuse_head(
    *,
    method: bytes,
    path: bytes,
    content_length: int | None,
    authorization: bytes | None,
    keys: Mapping[str, str] | None,
    auth_required: bool,
    max_body: int,
) -> ProxyError | None:
    """Return the error a request must get from its head alone, or None.

    `keys` is None while the serving process has no configuration yet (the
    proxy decides then). A key is checked only on the gateway's keyed upload
    paths; the size on every path.
    """
    if (
        auth_required
        and keys is not None
        and method == b"POST"
        and path.partition(b"?")[0].decode("latin-1") in KEYED_UPLOAD_PATHS
        and find_key_prefix(keys, authorization) is None
    ):
        return missing_key()
    if content_length is not None and content_length > max_body:
        return too_large(max_body)
    return None
