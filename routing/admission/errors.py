"""Why admission control refused a request, in the words a client is told.

Each error knows its HTTP status, OpenAI error code and whether retrying soon
can help (``retry_after`` seconds, or None). The seed's error table: the queue
full for a new flow (ErrTooManyFlows), the flow's own queue full
(ErrInsufficientFlowCapacity), the TTL, preemption, the client's deadline, and
the client gone (499, never sent: there is nobody to send it to).
"""

from __future__ import annotations


class AdmissionError(Exception):
    """A request admission control will not send to a backend."""

    status = 503
    code = "admission_error"
    error_type = "server_error"
    # Seconds after which a retry may succeed; None: do not suggest one.
    retry_after: int | None = 1

    def __init__(self, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retry_after is not None:
            self.retry_after = retry_after


class QueueFull(AdmissionError):
    """The whole queue holds total_capacity requests (ErrTooManyFlows)."""

    code = "queue_full"


class FlowQueueFull(AdmissionError):
    """This flow already has flow_capacity requests waiting."""

    code = "flow_queue_full"


class QueueTTLExpired(AdmissionError):
    """The request waited longer than queue_ttl."""

    code = "queue_ttl_expired"


class Preempted(AdmissionError):
    """A more critical request took this one's place in a full queue."""

    code = "preempted"


class DeadlineExceeded(AdmissionError):
    """The request waited past the deadline its client gave."""

    status = 504
    code = "deadline_exceeded"
    retry_after = None


class ClientCancelled(AdmissionError):
    """The client left while its request waited (recorded as 499)."""

    status = 499
    code = "client_closed"
    error_type = "invalid_request_error"
    retry_after = None
