"""The mock backend's control API, the routes under ``/_mock/`` that tests call.

GET /_mock/stats reads the counters; GET /_mock/config reads the effective
configuration and POST changes knobs (``refuse`` and ``refuse_for_ms`` in the
same body stop taking connections, as if the backend went down); POST
/_mock/hold and /_mock/release hold requests in their slots
(``nexus_mock.slots``); POST /_mock/reset goes back to the start-up
configuration with zeroed counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nexus_mock.answers import require_method
from nexus_mock.http_parsing import Request
from nexus_mock.jobs import ApiError, parse_json_object

if TYPE_CHECKING:
    from nexus_mock.server import MockBackend

CONTROL_PREFIX = "/_mock/"


def answer_control(
    backend: MockBackend, request: Request
) -> tuple[dict[str, Any], float | None, bool]:
    """Carry out a control request; return its body and how long to refuse.

    The second and third values are the milliseconds to refuse connections for
    and whether to refuse until told otherwise. Raises ApiError for a bad request.
    """
    route = request.path[len(CONTROL_PREFIX) :].rstrip("/")
    refuse_for: float | None = None
    refuse_forever = False
    if route == "stats":
        require_method(request, "GET")
        body = backend.describe_stats()
    elif route == "config" and request.method == "GET":
        body = backend.describe_config()
    elif route == "config":
        require_method(request, "POST", "GET")
        changes = parse_json_object(request.body)
        refuse_for, refuse_forever = _pop_refuse(changes)
        backend.change_config(changes)
        body = backend.describe_config()
    elif route == "hold":
        # {"first": N}: hold the next N requests that get a slot until
        # the Nth arrives, so that a test sees them at the mock at once
        # however slowly a loaded machine sends them.
        require_method(request, "POST")
        first = parse_json_object(request.body).get("first")
        if not isinstance(first, int) or isinstance(first, bool) or first < 1:
            raise ApiError(400, "first must be a positive integer.")
        backend.slots.hold_next(first)
        body = {"holding": first}
    elif route == "release":
        require_method(request, "POST")
        body = {"released": backend.slots.release_held()}
    elif route == "reset":
        require_method(request, "POST")
        backend.reset()
        body = backend.describe_config()
    else:
        raise ApiError(404, f"Invalid URL ({request.method} {request.path})")
    return body, refuse_for, refuse_forever


def _pop_refuse(changes: dict[str, Any]) -> tuple[float | None, bool]:
    """Take the refuse actions out of a config change; they are not knobs."""
    refuse_for = changes.pop("refuse_for_ms", None)
    refuse = changes.pop("refuse", False)
    if refuse_for is not None and (
        isinstance(refuse_for, bool)
        or not isinstance(refuse_for, int | float)
        or not 0 < refuse_for <= 3_600_000
    ):
        raise ApiError(
            400,
            "refuse_for_ms must be a number of milliseconds from 1 to 3600000.",
            param="refuse_for_ms",
        )
    if not isinstance(refuse, bool):
        raise ApiError(400, "refuse must be a boolean.", param="refuse")
    return refuse_for, refuse
