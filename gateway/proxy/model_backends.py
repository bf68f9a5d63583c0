"""Which backend an Ollama model-management request goes to, and who may ask.

Shared by model management (gateway/proxy/model_management.py) and model
files (gateway/proxy/model_blobs.py): a key with ``can_manage_models``; the
backend named by ``?backend=NAME`` or the ``x-nexus-backend`` header (an
Ollama backend, or a relay backend whose worker's owner allows management),
or else the only enabled Ollama backend.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from gateway.proxy.errors import ProxyError
from gateway.proxy.legs import ProxyExchange
from routing.core import BackendSpec
from routing.state import GatewayState
from usage.limits.policy import KeyPolicy

BACKEND_HEADER = b"x-nexus-backend"
BACKEND_PARAM = "backend"
OLLAMA_KIND = "ollama"
RELAY_KIND = "relay"  # backends.models.BackendKind.RELAY
_MAX_NAME = 200


def check_may_manage(exchange: ProxyExchange, draining: bool) -> KeyPolicy:
    """The key's policy, if it may manage models now (ProxyError if not)."""
    if draining:
        exchange.response_headers += ((b"connection", b"close"),)
        raise ProxyError(
            503,
            "This Nexus server is shutting down; retry the request.",
            error_type="server_error",
            code="shutting_down",
        )
    policy = exchange.policy
    if policy is None or not policy.can_manage_models:
        raise ProxyError(
            403,
            f"This key may not manage models ({exchange.path}): it needs the "
            "can_manage_models permission (the admin's key page, the API's "
            "keys, manage_models in the config file, or `manage.py "
            "nexus_create_key --manage-models`).",
            error_type="permission_error",
            code="model_management_forbidden",
        )
    return policy


def choose_backend(state: GatewayState, name: str | None) -> BackendSpec:
    """The backend a management request goes to (ProxyError if none fits)."""
    routes = state.routes
    if name is not None:
        backend = routes.backends_by_name.get(name)
        if backend is None:
            raise ProxyError(
                404,
                f"There is no backend named '{name}'.",
                code="backend_not_found",
            )
        if backend.kind not in (OLLAMA_KIND, RELAY_KIND):
            raise ProxyError(
                400,
                f"The backend '{name}' is not an Ollama server (its kind is "
                f"{backend.kind}): only Ollama backends (direct, or behind a "
                "relay worker) pull, push, copy, create and delete models.",
                code="not_an_ollama_backend",
            )
        return backend
    ollamas = [b for b in routes.backends if b.kind == OLLAMA_KIND and b.enabled]
    if not ollamas:
        raise ProxyError(
            404,
            "There is no enabled Ollama backend to manage models on.",
            code="backend_not_found",
        )
    if len(ollamas) > 1:
        names = ", ".join(sorted(b.name for b in ollamas))
        raise ProxyError(
            400,
            f"There are {len(ollamas)} Ollama backends ({names}): name one with "
            "the query parameter ?backend=NAME or the header x-nexus-backend.",
            code="backend_ambiguous",
        )
    return ollamas[0]


def named_backend(exchange: ProxyExchange, query: bytes) -> str | None:
    """The backend named in the query or the header (400 if they disagree)."""
    from_query = parse_qs(query.decode("latin-1")).get(BACKEND_PARAM)
    named = {value.strip() for value in from_query or ()}
    for header, value in exchange.request_headers:
        if header == BACKEND_HEADER:
            named.add(value.decode("latin-1").strip())
    named.discard("")
    if len(named) > 1:
        raise ProxyError(
            400,
            "Name one backend: the query and the x-nexus-backend header name "
            "different ones.",
            code="backend_ambiguous",
        )
    name = named.pop() if named else None
    if name is not None and len(name) > _MAX_NAME:
        raise ProxyError(
            404, "There is no backend by that name.", code="backend_not_found"
        )
    return name


def unreachable(backend: BackendSpec, detail: str, status: int) -> ProxyError:
    return ProxyError(
        status,
        f"The backend {backend.name} did not answer: {detail}.",
        error_type="server_error",
        code="upstream_timeout" if status == 504 else "upstream_unavailable",
    )
