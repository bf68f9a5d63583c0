"""Reading a backend's answer far enough to judge it, before the client sees it.

A whole reply (or a stream's first event) is read and checked before anything
goes to the client, so a backend that fails or answers nonsense can still be
retried (``forward``). These raise ``checks.UpstreamFault`` for an answer that
is a backend fault, and leave the transport's errors to the caller.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from gateway.protocols.base import StreamFailed
from gateway.proxy import checks, sse
from gateway.proxy.errors import ProxyError
from gateway.proxy.legs import Leg, LegStream, ProxyExchange
from gateway.relay.dispatch import RelayUnavailable

TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


def describe(error: BaseException) -> str:
    """Say in a few words what went wrong talking to a backend."""
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, aiohttp.ClientConnectorError):
        return "connection failed"
    if isinstance(error, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "closed the connection"
    if isinstance(error, RelayUnavailable):
        return f"no relay worker took it ({error})"
    return "transport error"


def is_event_stream(exchange: ProxyExchange, response: aiohttp.ClientResponse) -> bool:
    return (
        exchange.stream
        and response.status < 300
        and "event-stream" in response.headers.get("Content-Type", "")
    )


def is_leg_stream(
    exchange: ProxyExchange, response: aiohttp.ClientResponse, leg: Leg
) -> bool:
    content_type = response.headers.get("Content-Type", "")
    return (
        exchange.stream
        and response.status < 300
        and leg.adapter.is_stream(content_type, leg.native)
    )


def checked_reply(
    exchange: ProxyExchange, status: int, body: bytes
) -> dict[str, Any] | None:
    """Return the parsed body of a success (None for an error reply)."""
    if status >= 300:
        return None
    if exchange.stream:
        # Asked for a stream, answered something else with a success status.
        raise checks.invalid("answered a stream request without an event stream")
    return checks.check_reply_body(exchange.endpoint, body)


async def first_events(
    response: aiohttp.ClientResponse, relay: sse.StreamRelay, max_event: int
) -> bytes:
    """Read up to the stream's first data event and check it; return what to send.

    Raises UpstreamFault when the first event is not JSON, is over the limit,
    or the stream ends before it.
    """
    sent: list[bytes] = []
    try:
        async for data in response.content.iter_any():
            out = relay.feed(data)
            if out:
                sent.append(out)
                if checks.check_first_event(out):
                    return b"".join(sent)
    except sse.EventTooLarge:
        raise checks.event_too_large(max_event) from None
    except sse.InvalidEvent as error:
        first = b"".join([*sent, error.before])
        if checks.check_first_event(first):
            # A valid first event came before it (in the same read): the stream
            # starts, and the relay ends it at the broken event, however the
            # backend's bytes were cut into reads.
            relay.broken = True
            return first
        # Nothing reached the client yet: the next candidate may do better.
        raise checks.invalid("sent a stream event that is not a JSON object") from None
    raise checks.invalid("ended its stream before the first event")


def leg_answer(
    exchange: ProxyExchange,
    leg: Leg,
    status: int,
    response: aiohttp.ClientResponse,
    body: bytes,
) -> bytes:
    """Return the client's body for a leg's whole answer, checked.

    A backend that speaks the client's protocol has its answer passed through:
    a success must still be a JSON object, and an error that is not JSON is
    replaced (and logged) like on the OpenAI path.
    """
    if leg.native:
        if status < 300:
            if checks.json_object_of(body) is None:
                raise checks.invalid("answered a success that is not a JSON object")
        elif checks.json_object_of(body) is None:
            _, exchange.error = checks.error_reply(
                status,
                response.headers.get("Content-Type", ""),
                body,
                leg.target.backend.name,
                exchange.request_id,
            )
            return leg.call.surface.error_body(
                ProxyError(
                    status,
                    f"The backend '{leg.target.backend.name}' answered HTTP {status} "
                    "with an error the gateway does not pass on; the gateway's log "
                    f"has it (request id {exchange.request_id}).",
                    error_type="server_error" if status >= 500 else "upstream_error",
                    code="upstream_error",
                )
            )
    try:
        return leg.answer(exchange, status, body)
    except (ValueError, UnicodeDecodeError):
        raise checks.invalid("answered a success its protocol does not allow") from None


async def first_leg_events(
    response: aiohttp.ClientResponse,
    stream: LegStream,
    ndjson: bool = False,
    counted: bool = False,
) -> list[tuple[bytes, int]]:
    """Return a leg's first bytes for the client, once they exist.

    ``ndjson``: the client's stream is JSON lines (Ollama's), not SSE.
    ``counted``: cut per event with their characters of text (for a meter);
    else one piece.
    """
    check = checks.check_first_line if ndjson else checks.check_first_event
    sent: list[tuple[bytes, int]] = []
    try:
        async for data in response.content.iter_any():
            if counted:
                pieces = stream.feed_counted(data)
                out = b"".join([piece for piece, _ in pieces])
                sent += pieces
            else:
                out = stream.feed(data)
                if out:
                    sent.append((out, 0))
            if out and check(out):
                return sent
    except StreamFailed as error:
        raise checks.invalid(error.message) from None
    raise checks.invalid("ended its stream before the first event")


def text_length(payload: dict[str, Any]) -> int:
    """Count the characters of text in a chat or completions reply."""
    total = 0
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        text = (
            message.get("content") if isinstance(message, dict) else choice.get("text")
        )
        if isinstance(text, str):
            total += len(text)
    return total
