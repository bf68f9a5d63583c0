"""What a serving process of one role answers outside its role (NEXUS_ROLE).

A gateway-only process (``NEXUS_ROLE=gateway``) serves /v1, Ollama's API,
/health, /metrics and the relay WebSocket; every other path gets a JSON 404
naming the control plane (no template is loaded to render a page). A
control-only process (``NEXUS_ROLE=control``) answers the gateway's paths
with a 404 in OpenAI's error shape naming the gateway, and a relay worker
with close code 4404. Both say so rather than pretend the path does not
exist anywhere.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from nexus_worker.protocol import CloseCode

logger = logging.getLogger(__name__)

GATEWAY_ONLY = (
    "This Nexus process serves the gateway only (NEXUS_ROLE=gateway): /v1, "
    "Ollama's /api/*, /health, /metrics and the relay WebSocket. The admin, "
    "the dashboard and the management API are served by the control processes."
)
CONTROL_ONLY = (
    "This Nexus process serves the control plane only (NEXUS_ROLE=control): the "
    "admin, the dashboard and the management API. Send model requests to the "
    "gateway processes."
)


def _error(status: int, message: str, code: str) -> JsonResponse:
    return JsonResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": code}},
        status=status,
    )


def gateway_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """A gateway-only process's 404: the path is the control plane's, or none."""
    return _error(404, f"Not found: {request.path_info}. {GATEWAY_ONLY}", "not_found")


def gateway_bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    return _error(400, "Bad request.", "bad_request")


def gateway_forbidden(request: HttpRequest, exception: Exception) -> HttpResponse:
    return _error(403, "Forbidden.", "forbidden")


def gateway_server_error(request: HttpRequest) -> HttpResponse:
    return _error(
        500, "Internal server error; the server's log has the details.", "server_error"
    )


class NotServedHere:
    """The ASGI app a control-only process answers the gateway's paths with."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"Not found: {scope['path']}. {CONTROL_ONLY}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "not_found",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 404,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class RelayElsewhere:
    """The ASGI app a control-only process answers the relay WebSocket with.

    Relay workers belong to the gateway processes (docs/kubernetes.md): a
    worker that dials this one is accepted and closed at once with 4404,
    which nexus-worker reports as "point the worker at the gateway".
    """

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        logger.warning(
            "A relay worker from %s dialled this control-only process "
            "(NEXUS_ROLE=control): workers connect to the gateway",
            (scope.get("client") or ("unknown",))[0],
        )
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": int(CloseCode.NOT_SERVED_HERE)})
