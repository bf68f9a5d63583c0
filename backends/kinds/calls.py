"""Ask many backends one thing at once: the shared shape of health and discovery.

``call_backends()`` opens one ``httpx.AsyncClient`` for the round and calls
every backend concurrently through its kind's adapter, each within its own
timeout. One backend's failure (unknown kind, timeout, refused connection, an
odd answer, even a bug in an adapter) becomes that backend's ``Answer.error``
and never sinks the round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

import httpx

from backends.kinds import get_adapter
from backends.kinds.base import (
    BackendKindAdapter,
    Endpoint,
    ProbeFailed,
    describe_error,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# One adapter call: what it asks a backend.
Ask = Callable[[BackendKindAdapter, httpx.AsyncClient, Endpoint], Awaitable[T]]


@dataclass(frozen=True, slots=True)
class Answer(Generic[T]):
    """What one backend answered, or why it did not, and when the call ran.

    ``error`` is set (short, safe to store and show) when the call failed;
    ``value`` is then None. Times are wall-clock UTC, for the database.
    """

    started_at: datetime
    finished_at: datetime
    value: T | None = None
    error: str = ""


async def call_backends(
    endpoints: Mapping[int, Endpoint],
    ask: Ask[T],
    *,
    timeout: float,
    connections_per_backend: int,
    keep_alive: bool = True,
    action: str = "Calling",
) -> dict[int, Answer[T]]:
    """Call `ask` for every endpoint at once; return each one's answer by key.

    ``action`` names the call in the warning logged when it fails unexpectedly
    ("Probing", "Listing models of").
    """
    limits = httpx.Limits(
        max_connections=connections_per_backend * len(endpoints) + 10,
        max_keepalive_connections=None if keep_alive else 0,
    )
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout),
        limits=limits,
        # Backends sit on private networks; a user's HTTP proxy is not for them.
        trust_env=False,
        follow_redirects=False,
    ) as client:
        answers = await asyncio.gather(
            *(
                _call_one(client, endpoint, ask, timeout, action)
                for endpoint in endpoints.values()
            )
        )
    return dict(zip(endpoints, answers, strict=True))


async def _call_one(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    ask: Ask[T],
    timeout: float,
    action: str,
) -> Answer[T]:
    started_at = datetime.now(UTC)
    started = time.perf_counter()
    value: T | None = None
    error = ""
    try:
        adapter = get_adapter(endpoint.kind)
    except KeyError:
        error = f"unknown backend kind {endpoint.kind!r}"
    else:
        try:
            async with asyncio.timeout(timeout):
                value = await ask(adapter, client, endpoint)
        except (TimeoutError, httpx.HTTPError, ProbeFailed) as failure:
            error = describe_error(failure, timeout=timeout)
        except Exception as failure:
            logger.warning("%s %s failed", action, endpoint.name, exc_info=True)
            error = describe_error(failure)
    finished_at = started_at + timedelta(seconds=time.perf_counter() - started)
    return Answer(started_at, finished_at, value, error)
