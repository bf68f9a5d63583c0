"""The internal credential a batch line carries to the serving processes.

The batch runner (a Celery worker) sends each line of a batch job to the
gateway over HTTP, as the key that created the batch, at the batch band. It
does not know that key (keys are stored hashed), so it signs who it acts for
and until when: ``X-Nexus-Batch: <key prefix>.<batch id>.<expiry>.<signature>``,
an HMAC-SHA256 with a secret derived from Django's SECRET_KEY, which the
workers and the serving processes share; the expiry (Unix seconds) is the
batch's own, so a credential that leaked stops working with its batch. The gateway checks the signature (no database), bills the
line to that key with its allow-list, limits and budgets, marks its usage
record as a batch line, and admits it in the batch lane. A client cannot
forge the header without the secret; a wrong one is refused (401).
"""

from __future__ import annotations

import hashlib
import hmac
import time

HEADER = "X-Nexus-Batch"
HEADER_BYTES = HEADER.lower().encode()
_CONTEXT = b"nexus batch line credential v1"
_ANONYMOUS = "-"  # the owner when client auth is off and no key created it


def derive_secret(secret_key: str) -> bytes:
    """The credential's signing key, derived from Django's SECRET_KEY."""
    return hmac.new(secret_key.encode(), _CONTEXT, hashlib.sha256).digest()


def sign(secret: bytes, key_prefix: str, batch_id: str, expires: int) -> str:
    """The header value for lines of batch `batch_id` owned by `key_prefix`,
    valid until `expires` (Unix seconds)."""
    signed = f"{key_prefix or _ANONYMOUS}.{batch_id}.{expires}"
    return f"{signed}.{_signature(secret, signed)}"


def verify(
    secret: bytes, value: bytes, now: float | None = None
) -> tuple[str, str] | None:
    """The (key prefix, batch id) a header value names; None if it is not
    ours or has expired."""
    if not secret or len(value) > 512:
        return None
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    signed, _, signature = text.rpartition(".")
    owner, _, rest = signed.partition(".")
    batch_id, _, expires = rest.rpartition(".")
    if not owner or not batch_id or not expires.isdigit() or not signature:
        return None
    if not hmac.compare_digest(_signature(secret, signed), signature):
        return None
    if int(expires) < (time.time() if now is None else now):
        return None
    return ("" if owner == _ANONYMOUS else owner), batch_id


def _signature(secret: bytes, signed: str) -> str:
    return hmac.new(secret, signed.encode(), hashlib.sha256).hexdigest()
