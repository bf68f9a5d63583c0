"""Why the fleet scheduler did not run a request (the proxy turns these into 503s)."""

from __future__ import annotations


class FleetRefusal(Exception):
    """A request the fleet's queues did not run; ``code`` names why."""

    code = "fleet_refused"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class QueueFull(FleetRefusal):
    """The chosen backend x model line already holds fleet_queue_length waiters."""

    code = "queue_full"


class QueueTimeout(FleetRefusal):
    """The request waited fleet_queue_timeout_seconds without getting a slot."""

    code = "queue_timeout"
