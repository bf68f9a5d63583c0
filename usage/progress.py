"""The requests a serving process has open, and their progress. No ORM, no I/O.

The proxy opens a request when it enters the pipeline: a ``UsageOpen`` goes
to the buffer (an append, as its settle will be) and the request is tracked
here until its settle. Every ``interval`` seconds, off the request path, this
service appends a progress item for each tracked request whose numbers
changed (the backend it reached, the tokens counted so far: what it would be
billed if it ended now), and one ``UsageBeat`` for the process while any
request is open. The flusher turns those into ``OpenRequest`` rows, and the
beat reconciliation (``usage/lost.py``) bills the open requests of a process
no longer heard of. A process with nothing open says nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from nexus_lib.service import periodic
from usage.buffer import UsageBeat, UsageBuffer, UsageOpen, process_id

logger = logging.getLogger(__name__)

# (backend, served model, prompt, completion, total tokens, cost, status) so far.
Progress = tuple[str, str, int, int, int, int, int]


def _nothing_yet(request: Any) -> Progress | None:
    return None


class OpenRequests:
    """Requests opened and not yet settled in this process (see the module).

    A service (nexus_lib.service). ``progress_of`` reads a tracked request's
    numbers; the proxy sets it (this package knows nothing of its requests).
    """

    name = "usage-progress"

    def __init__(self, buffer: UsageBuffer, interval: float) -> None:
        self.buffer = buffer
        self.interval = interval
        self.progress_of: Callable[[Any], Progress | None] = _nothing_yet
        # event id -> (the open item, the proxy's request)
        self.requests: dict[str, tuple[UsageOpen, Any]] = {}
        self._reported: dict[str, UsageOpen] = {}
        self._reporting = periodic(
            "usage-progress", lambda: self.interval, self.report, log=logger.error
        )

    def open(self, item: UsageOpen, request: Any) -> None:
        """Hand the open on and track the request until ``settle()``."""
        self.buffer.append(item)
        self.requests[item.event_id] = (item, request)

    def settle(self, event_id: str) -> None:
        """Stop tracking the request (its settle goes to the buffer)."""
        self.requests.pop(event_id, None)

    def start(self) -> None:
        self._reporting.start()

    async def stop(self) -> None:
        await self._reporting.stop()

    def report(self) -> int:
        """Append progress of the requests that changed, and a beat; return how
        many progressed."""
        requests, reported = self.requests, self._reported
        for gone in reported.keys() - requests.keys():
            del reported[gone]
        if not requests:
            return 0
        progressed = 0
        for event_id, (opened, request) in list(requests.items()):
            numbers = self.progress_of(request)
            if numbers is None:
                continue
            backend, served, prompt, completion, total, cost, status = numbers
            item = dataclasses.replace(
                opened,
                backend=backend,
                served_model=served,
                prompt_tokens=prompt,
                completion_tokens=completion,
                total_tokens=total,
                cost_nanos=cost,
                status=status,
            )
            if reported.get(event_id) != item:
                reported[event_id] = item
                self.buffer.append(item)
                progressed += 1
        self.buffer.append(UsageBeat(process_id()))
        return progressed
