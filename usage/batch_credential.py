"""The internal credential a batch line carries to the serving processes.

The batch runner (a Celery worker) sends each line of a batch job to the
gateway over HTTP, as the key that created the batch, at the batch band. It
does not know that key (keys are stored hashed), so it signs who it acts for:
``X-Nexus-Batch: <key prefix>.<batch id>.<signature>``, an HMAC-SHA256 with a
secret derived from Django's SECRET_KEY, which the workers and the serving
processes share. The gateway checks the signature (no database), bills the
line to that key with its allow-list, limits and budgets, marks its usage
record as a batch line, and admits it in the batch lane. A client cannot
forge the header without the secret; a wrong one is refused (401).
"""

from __future__ import annotations

import hashlib
import hmac

HEADER = "X-Nexus-Batch"
HEADER_BYTES = HEADER.lower().encode()
_CONTEXT = b"nexus batch line credential v1"
_ANONYMOUS = "-"  # the owner when client auth is off and no key created it


def derive_secret(secret_key: str) -> bytes:
    """The credential's signing key, derived from Django's SECRET_KEY."""
    return hmac.new(secret_key.encode(), _CONTEXT, hashlib.sha256).digest()


def sign(secret: bytes, key_prefix: str, batch_id: str) -> str:
    """The header value for lines of batch `batch_id` owned by `key_prefix`."""
    owner = key_prefix or _ANONYMOUS
    return f"{owner}.{batch_id}.{_signature(secret, owner, batch_id)}"


def verify(secret: bytes, value: bytes) -> tuple[str, str] | None:
    """The (key prefix, batch id) a header value names, None if it is not ours."""
    if not secret or len(value) > 512:
        return None
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    owner, _, rest = text.partition(".")
    batch_id, _, signature = rest.rpartition(".")
    if not owner or not batch_id or not signature:
        return None
    expected = _signature(secret, owner, batch_id)
    if not hmac.compare_digest(expected, signature):
        return None
    return ("" if owner == _ANONYMOUS else owner), batch_id


def _signature(secret: bytes, owner: str, batch_id: str) -> str:
    message = f"{owner}.{batch_id}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()
