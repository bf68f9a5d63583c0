"""Ollama model management through a relay worker (an Ollama server behind NAT).

The worker's relay protocol carries it as it carries inference: the request
(with its method: ``DELETE /api/delete``) in a frame, the progress back as
text chunks while the worker's Ollama sends it, the end with its status. Only
a worker whose owner started it with ``--allow-model-management`` forwards
it, and only to an Ollama server; any other (an older worker too) refuses,
and the client gets a 501 saying why. The request goes to the named worker
only, never requeued to another serving the model. The worker lists its
models again before it ends the answer and reports them over its socket; the
gateway applies them as any worker's models_update (its version bumps are
coalesced, NEXUS_RELAY_CONFIG_COALESCE_SECONDS), so the change is served
within a second or two of the answer's end rather than at it. Model files
(``/api/blobs``) do not go this way: gateway/proxy/model_blobs.py.
"""

from __future__ import annotations

from gateway.proxy.errors import ProxyError
from gateway.proxy.legs import ProxyExchange
from gateway.proxy.model_backends import unreachable
from gateway.relay.dispatch import (
    RelayHub,
    RelayRefused,
    RelayResponse,
    RelayUnavailable,
)
from routing.core import BackendSpec, ModelSpec, Target

# What a worker says when it does not take model management: a worker of
# this Nexus (management_not_allowed), an older one (endpoint_not_allowed).
_NOT_TAKEN = ("does not manage models", "is not Ollama", "is not forwarded here")


async def open_through_relay(
    hub: RelayHub,
    exchange: ProxyExchange,
    backend: BackendSpec,
    method: str,
    raw: bytes,
    model: str,
    stream: bool,
) -> RelayResponse:
    """Send the management request to `backend`'s worker; return its answer
    (read like aiohttp's: status, headers, content; close it when done)."""
    target = Target(backend, ModelSpec(name=model[:200] or "?"))
    try:
        return await hub.open(
            target,
            exchange.request_id,
            exchange.path,
            raw,
            {"content-type": "application/json"},
            stream,
            method=method,
            requeue=False,
        )
    except RelayRefused as error:
        raise ProxyError(error.status, str(error)) from None
    except RelayUnavailable as error:
        reason = str(error)
        if any(words in reason for words in _NOT_TAKEN):
            raise ProxyError(
                501,
                f"The relay worker of backend '{backend.name}' does not take "
                f"model management ({reason}). Its owner may start nexus-worker "
                "with --allow-model-management, in front of an Ollama server (a "
                "worker older than this gateway does not know the option); or "
                "run the command on the worker's machine.",
                error_type="server_error",
                code="management_not_relayed",
            ) from None
        raise unreachable(backend, reason, 502) from None
