"""An Ollama model operation's progress (NDJSON lines), read to its end.

A pull, push or create asked without a stream is asked of the backend as a
stream all the same (gateway/proxy/model_management.py) and answered with its
last line, as Ollama answers: the final status, or a 500 with the error that
ended it. Lines are bounded (1 MiB).
"""

from __future__ import annotations

import json

import aiohttp

from gateway.proxy.replies import TRANSPORT_ERRORS, describe
from gateway.proxy.sse import LineSplitter
from gateway.relay.dispatch import RelayResponse
from routing.core import BackendSpec

# A backend's answer: aiohttp's, or a relay worker's read the same way.
Response = aiohttp.ClientResponse | RelayResponse
MAX_PROGRESS_LINE = 1024 * 1024


async def last_line(backend: BackendSpec, response: Response) -> tuple[int, bytes]:
    """The status and body that a stream's last line makes (bounded lines)."""
    splitter = LineSplitter()
    last = b""
    try:
        async for data in response.content.iter_any():
            for line in splitter.feed(data):
                if line.strip():
                    last = line
            if splitter.pending_size > MAX_PROGRESS_LINE:
                return _broke(backend, "a progress line over 1 MiB", 502)
        rest = splitter.rest()
        if rest.strip():
            last = rest
    except TimeoutError:
        return _broke(backend, "no progress within its request timeout", 504)
    except TRANSPORT_ERRORS as error:
        return _broke(backend, describe(error), 502)
    try:
        final = json.loads(last)
    except ValueError:
        return _broke(backend, "its answer ended without a status line", 502)
    if not isinstance(final, dict):
        return _broke(backend, "its last line is not a JSON object", 502)
    body = json.dumps(final).encode()
    return (500 if "error" in final else 200), body


def _broke(backend: BackendSpec, detail: str, status: int) -> tuple[int, bytes]:
    message = f"Nexus: the backend {backend.name} broke off: {detail}."
    return status, json.dumps({"error": message}).encode()
