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
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.proxy.errors import ProxyError, unauthorized
from gateway.proxy.surfaces import (
    COUNT_TOKENS_PATH,
    ENDPOINTS,
    OPENAI,
    Surface,
    is_ollama_blob,
)

# POST paths of the gateway that need a client key, with the surface whose
# error shape they answer in: every surface's inference endpoints.
KEYED_UPLOAD_PATHS: dict[str, Surface] = {
    **{path: surface for path, (_, surface) in ENDPOINTS.items()},
    COUNT_TOKENS_PATH: ENDPOINTS["/v1/messages"][1],
    # Batch uploads (gateway/batches/): up to NEXUS_BATCH_MAX_FILE_BYTES each.
    "/v1/files": OPENAI,
    "/v1/messages/batches": ENDPOINTS["/v1/messages"][1],
}


# Ollama's error shape: an upload of a model file (/api/blobs/<digest>).
_OLLAMA = ENDPOINTS["/api/chat"][1]


def surface_of(path: bytes) -> Surface:
    """The surface whose error shape an upload to `path` is answered in."""
    name = path.partition(b"?")[0].decode("latin-1")
    return _OLLAMA if is_ollama_blob(name) else KEYED_UPLOAD_PATHS.get(name, OPENAI)


def is_blob_upload(method: bytes, path: bytes) -> bool:
    """Whether the request uploads one of Ollama's model files."""
    return method == b"POST" and is_ollama_blob(
        path.partition(b"?")[0].decode("latin-1")
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
    # A batch line's signed credential (usage.batch_credential): the proxy
    # checks it, as it checks keys, once the body is in.
    batch_credential: bool = False


def refuse_head(
    head: RequestHead,
    keys: Mapping[str, str] | None,
    *,
    auth_required: bool,
    max_body: int,
    max_blob: int = 0,
    may_manage: Callable[[str], bool] | None = None,
) -> tuple[ProxyError, Surface] | None:
    """Return the error a request must get from its head alone, or None.

    With the error comes the surface whose shape it is answered in. `keys` is
    None while the serving process has no configuration yet (the proxy decides
    then). A key (``Authorization: Bearer``, or ``x-api-key`` where the
    surface takes it) is checked only on the gateway's keyed upload paths; the
    size on every path. An upload of an Ollama model file may be up to
    `max_blob` bytes, and only with a key that `may_manage` models (a
    multi-GB file is refused before it costs a byte of disk).
    """
    if is_blob_upload(head.method, head.path):
        return _refuse_blob(head, keys, max_blob, may_manage)
    surface = KEYED_UPLOAD_PATHS.get(head.path.partition(b"?")[0].decode("latin-1"))
    if (
        surface is not None
        and auth_required
        and keys is not None
        and head.method == b"POST"
        and not head.batch_credential
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


def _refuse_blob(
    head: RequestHead,
    keys: Mapping[str, str] | None,
    max_blob: int,
    may_manage: Callable[[str], bool] | None,
) -> tuple[ProxyError, Surface] | None:
    if keys is not None:
        prefix = find_key_prefix(keys, head.authorization)
        if prefix is None:
            return missing_key(), _OLLAMA
        if may_manage is not None and not may_manage(prefix):
            return blob_forbidden(), _OLLAMA
    length = head.content_length
    if length is not None and length > max_blob:
        return too_large(max_blob), _OLLAMA
    return None


def blob_forbidden() -> ProxyError:
    """The 403 for a model file uploaded with a key that may not manage models."""
    return ProxyError(
        403,
        "This key may not manage models (/api/blobs): it needs the "
        "can_manage_models permission (the admin's key page, the API's keys, "
        "manage_models in the config file, or `manage.py nexus_create_key "
        "--manage-models`).",
        error_type="permission_error",
        code="model_management_forbidden",
    )
