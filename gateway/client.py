"""The pooled client every upstream request goes through, and its reply limits.

One ``aiohttp.ClientSession`` per serving process (opened by the gateway on
its event loop) carries every upstream request, so connections are pooled and
nothing is constructed per request. httpx stays the client everywhere off the
hot path; its request layer measured a third of the gateway's throughput here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from routing.core import Target

_STREAM_OPTIONS = b',"stream_options":{"include_usage":true}}'


@dataclass(frozen=True, slots=True)
class ReplyLimits:
    """How much of an upstream reply, and of a slow reader, the proxy accepts."""

    max_reply: int = 32 * 1024 * 1024  # non-stream body
    max_event: int = 1024 * 1024  # one SSE event
    max_unsent: int = 1024 * 1024  # stream bytes the client has not read
    stall_seconds: float = 10.0  # how long a client may stay over max_unsent


class UpstreamClient:
    """The serving process's pooled HTTP client, bound to one event loop."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout: float,
        limits: ReplyLimits | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.limits = limits or ReplyLimits()
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def open(self) -> None:
        """Create the session on the running loop (at start-up, not per request)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self.max_connections,
                limit_per_host=0,
                ttl_dns_cache=60,
                enable_cleanup_closed=True,
            ),
            # The environment's proxy settings are for people, not for
            # backends on a private network.
            trust_env=False,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None:
            raise RuntimeError("The upstream client is not open (gateway not started)")
        return session

    def timeout(self, request_timeout: float) -> aiohttp.ClientTimeout:
        """Connect (incl. waiting for a pooled connection) and per-read limits."""
        timeout = self._timeouts.get(request_timeout)
        if timeout is None:
            timeout = self._timeouts[request_timeout] = aiohttp.ClientTimeout(
                total=None,
                connect=self.connect_timeout,
                sock_connect=self.connect_timeout,
                sock_read=request_timeout,
            )
        return timeout


def upstream_url(target: Target, path: str) -> str:
    return target.backend.base_url.removesuffix("/v1") + path


def upstream_body(
    payload: dict[str, Any], raw: bytes, target: Target, wants_usage_chunk: bool
) -> bytes:
    """The body to send: the client's bytes unless the model or usage must change.

    Asking a stream for its usage block (when the client did not) appends the
    option to the client's bytes instead of serialising the body again.
    """
    same_model = payload.get("model") == target.model.name
    add_usage = payload.get("stream") is True and not wants_usage_chunk
    if same_model and not add_usage:
        return raw
    if same_model and "stream_options" not in payload:
        end = raw.rfind(b"}")  # the object's own closing brace: only space follows
        return raw[:end] + _STREAM_OPTIONS
    rewrite: dict[str, Any] = {"model": target.model.name}
    if add_usage:
        options = payload.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        options["include_usage"] = True
        rewrite["stream_options"] = options
    return json.dumps({**payload, **rewrite}, separators=(",", ":")).encode()
