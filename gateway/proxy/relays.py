"""Sending a backend's checked answer on to the client, bounded.

``forward`` (gateway/proxy/forward.py) picks the backend and reads its answer
far enough to judge it (gateway/proxy/replies.py); a ``Relay`` then sends it
on: a whole body at once, a stream event by event as it arrives, translated
for the client's protocol where a leg says so. Every relay notes on the
exchange what the accounting needs (status, usage or characters of text,
when the first byte went out, what cut it short).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from gateway.cache.entries import Pending
from gateway.client import ReplyLimits
from gateway.protocols.base import BUDGET, StreamFailed
from gateway.protocols.prompt_cache import usage_with_cache_timings
from gateway.proxy import checks, sse
from gateway.proxy.legs import Leg, LegStream, ProxyExchange
from gateway.proxy.replies import TRANSPORT_ERRORS, describe, text_length

Send = Callable[[dict[str, Any]], Awaitable[None]]

# How often a stream's client over the unsent-bytes bound is looked at again.
STALL_POLL_SECONDS = 0.02

_STREAM_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


class Relay:
    """One answer on its way to the client (built once the answer is judged).

    ``idle_timeout``: how long the backend may go without completing an event
    (its request timeout); ``limits.max_unsent``: how many sent bytes the
    client may leave unread (where the server tells:
    ``exchange.unsent_bytes``) for ``limits.stall_seconds`` before the stream
    is given up and the client disconnected.
    """

    __slots__ = ("exchange", "idle_timeout", "max_unsent", "send", "stall_seconds")

    def __init__(
        self,
        exchange: ProxyExchange,
        send: Send,
        idle_timeout: float,
        limits: ReplyLimits,
    ) -> None:
        self.exchange = exchange
        self.send = send
        self.idle_timeout = idle_timeout
        self.max_unsent = limits.max_unsent
        self.stall_seconds = limits.stall_seconds

    async def body(
        self,
        response: aiohttp.ClientResponse,
        body: bytes,
        reply: dict[str, Any] | None,
    ) -> None:
        """Send an OpenAI backend's whole reply (an error replaced if not JSON)."""
        exchange = self.exchange
        status = exchange.status = response.status
        if reply is not None:
            exchange.usage = usage_with_cache_timings(reply)
            if exchange.usage is None:
                exchange.completion_chars = text_length(reply)
            if exchange.cache is not None:
                exchange.cache.body = body
        else:
            body, exchange.error = checks.error_reply(
                status,
                response.headers.get("Content-Type", ""),
                body,
                exchange.backend,
                exchange.request_id,
            )
        exchange.first_byte = time.perf_counter()
        await self._send_whole(status, body)

    async def leg_body(self, status: int, body: bytes) -> None:
        """Send a leg's whole answer, already written for the client."""
        exchange = self.exchange
        exchange.status = status
        if status >= 300 and not exchange.error:
            exchange.error = f"upstream_{status}"
        exchange.first_byte = time.perf_counter()
        await self._send_whole(status, body)

    async def _send_whole(self, status: int, body: bytes) -> None:
        if self.exchange.cache is not None:
            await self._complete()
        await self.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *self.exchange.response_headers,
                ],
            }
        )
        await self.send({"type": "http.response.body", "body": body})

    async def stream(
        self, response: aiohttp.ClientResponse, relay: sse.StreamRelay, first: bytes
    ) -> None:
        """Relay the rest of a stream whose first events were read and checked.

        Ends the stream with an error event when the backend breaks, sends an
        event over the size limit, or goes ``idle_timeout`` seconds without
        completing an event; stops reading it when the client has not read
        ``max_unsent`` bytes of what was sent (a stalled reader).
        """
        exchange, send = self.exchange, self.send
        exchange.status = response.status
        exchange.live_chars = relay.text_length
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [*_STREAM_HEADERS, *exchange.response_headers],
            }
        )
        meter = exchange.meter
        pending = exchange.cache
        if pending is not None:
            pending.collect()
        goes_on = True
        unsent, max_unsent = exchange.unsent_bytes, self.max_unsent
        event_timeout = self.idle_timeout
        loop = asyncio.get_running_loop()
        tail = b""
        try:
            if meter is not None:
                first, goes_on = await meter.take(sse.counted_events(first))
            if pending is not None:
                _collect_events(pending, first)
            exchange.first_byte = time.perf_counter()
            await send({"type": "http.response.body", "body": first, "more_body": True})
            if relay.broken:
                raise sse.InvalidEvent(b"")
            async with asyncio.timeout_at(loop.time() + event_timeout) as deadline:
                while goes_on:
                    data = await response.content.readany()
                    if not data:
                        tail = relay.rest()
                        break
                    out = relay.feed(data)
                    if out:
                        deadline.reschedule(loop.time() + event_timeout)
                        if meter is not None:
                            # Cut after the event that crossed the budget.
                            out, goes_on = await meter.take(sse.counted_events(out))
                        if pending is not None:
                            _collect_events(pending, out)
                        await send(
                            {
                                "type": "http.response.body",
                                "body": out,
                                "more_body": True,
                            }
                        )
                        if (
                            unsent is not None
                            and unsent() > max_unsent
                            and await self._stays_unread(unsent, deadline)
                        ):
                            exchange.error = "client_stalled"
                            break
        except sse.EventTooLarge as error:
            tail = _too_large_event(exchange, error.args[0])
        except sse.InvalidEvent as error:
            # A later event the client's SDK could not parse: what came before it
            # goes out, then the error event; the caller closes the backend's
            # connection (the rest is never read).
            exchange.error = "upstream_invalid_response"
            before = error.before
            if before and meter is not None:
                before, goes_on = await meter.take(sse.counted_events(before))
            if before:
                await send(
                    {"type": "http.response.body", "body": before, "more_body": True}
                )
            tail = _invalid_event(exchange)
        except TRANSPORT_ERRORS as error:
            tail = _broken_stream(exchange, error)
        finally:
            # Also when the client left mid-stream: billed for what was relayed.
            if not goes_on:
                _cut_for_budget(exchange)
            else:
                exchange.usage = relay.usage
                if relay.usage is None:
                    exchange.completion_chars = relay.text_length()
        if meter is not None and not goes_on:
            cut = meter.cut_error()
            tail = sse.error_event(cut.message, BUDGET, cut.error_type)
        await self._end(tail)

    async def leg_stream(
        self,
        response: aiohttp.ClientResponse,
        leg: Leg,
        stream: LegStream,
        first_pieces: list[tuple[bytes, int]],
    ) -> None:
        """Relay (or translate) the rest of a leg's stream; bounded as ``stream``."""
        exchange, send = self.exchange, self.send
        exchange.status = response.status
        exchange.live_chars = lambda: stream.chars
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [
                    (b"content-type", leg.call.surface.stream_content_type),
                    *_STREAM_HEADERS[1:],
                    *exchange.response_headers,
                ],
            }
        )
        meter = exchange.meter
        goes_on = True
        unsent, max_unsent = exchange.unsent_bytes, self.max_unsent
        event_timeout = self.idle_timeout
        loop = asyncio.get_running_loop()
        tail = b""
        try:
            if meter is None:
                first = b"".join([piece for piece, _ in first_pieces])
            else:
                first, goes_on = await meter.take(first_pieces)
            exchange.first_byte = time.perf_counter()
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async with asyncio.timeout_at(loop.time() + event_timeout) as deadline:
                while goes_on:
                    data = await response.content.readany()
                    if not data:
                        if meter is None:
                            tail = stream.finish()
                        else:
                            tail, goes_on = await meter.take(stream.finish_counted())
                        break
                    if meter is None:
                        out = stream.feed(data)
                    else:
                        out, goes_on = await meter.take(stream.feed_counted(data))
                    if out:
                        deadline.reschedule(loop.time() + event_timeout)
                        await send(
                            {
                                "type": "http.response.body",
                                "body": out,
                                "more_body": True,
                            }
                        )
                        if (
                            unsent is not None
                            and unsent() > max_unsent
                            and await self._stays_unread(unsent, deadline)
                        ):
                            exchange.error = "client_stalled"
                            break
        except TRANSPORT_ERRORS as error:
            exchange.error = "upstream_stream_broken"
            tail = stream.fail(_mid_stream(exchange, describe(error)))
        except StreamFailed as error:
            exchange.error = "upstream_stream_error"
            tail = stream.fail(_mid_stream(exchange, error.message))
        finally:
            # Also when the client left mid-stream: billed for what was relayed.
            if not goes_on:
                _cut_for_budget(exchange)
            else:
                exchange.usage = stream.usage
                if stream.usage is None:
                    exchange.completion_chars = stream.chars
        if meter is not None and not goes_on:
            tail += stream.fail(meter.cut_error().message, BUDGET)
        await self._end(tail)

    async def _stays_unread(
        self, unsent: Callable[[], int], deadline: asyncio.Timeout
    ) -> bool:
        """Whether what the client left unread stays over the bound.

        A burst of events fills the server's buffer faster than its loop
        writes it out, for a client reading all the while: it is given
        ``stall_seconds`` to bring the buffer down to half the bound, and the
        backend is not read meanwhile (back-pressure). Only a client that
        stays behind for that long is stalled.
        """
        loop = asyncio.get_running_loop()
        until = loop.time() + self.stall_seconds
        deadline.reschedule(until + self.idle_timeout)
        while unsent() > self.max_unsent // 2:
            if loop.time() >= until:
                return True
            await asyncio.sleep(STALL_POLL_SECONDS)
        return False

    async def _end(self, tail: bytes) -> None:
        """Send the stream's last bytes; or, to a client that stopped reading,
        close its connection, dropping what it left unread (the server would
        otherwise hold it, up to max_unsent a connection, until it goes)."""
        exchange = self.exchange
        if exchange.error == "client_stalled" and exchange.abort is not None:
            exchange.abort()
            return
        if exchange.cache is not None:
            await self._complete()
        await self.send(
            {"type": "http.response.body", "body": tail, "more_body": False}
        )

    async def _complete(self) -> None:
        """Run what waits for the whole answer before its last byte goes out
        (the response cache keeping it: the client's next request finds it)."""
        pending = self.exchange.cache
        if pending is not None and pending.on_complete is not None:
            on_complete, pending.on_complete = pending.on_complete, None
            await on_complete()


def _collect_events(pending: Pending, data: bytes) -> None:
    """Hand the chunks of OpenAI stream bytes relayed to the cache's collector."""
    collector = pending.collector
    if collector is None or collector.too_large or pending.unreadable:
        return
    splitter = pending.splitter
    if splitter is None:
        splitter = pending.splitter = sse.EventSplitter()
    for event in splitter.feed(data):
        try:
            chunk = sse.event_payload(event)
        except ValueError:
            pending.unreadable = True
            return
        if chunk is not None:
            collector.add(chunk)


def _cut_for_budget(exchange: ProxyExchange) -> None:
    """A stream cut for its key's budget is billed as its meter counted it (a
    usage block read with the last events was not relayed)."""
    exchange.error = "budget_exceeded"
    exchange.usage = None
    exchange.completion_chars = exchange.meter.chars if exchange.meter else 0
    exchange.counted_completion = exchange.meter.completion if exchange.meter else 0


def _mid_stream(exchange: ProxyExchange, what: str) -> str:
    return (
        f"Backend '{exchange.backend}' failed mid-stream ({what}); "
        "the response is incomplete."
    )


def _too_large_event(exchange: ProxyExchange, size: object) -> bytes:
    exchange.error = "upstream_event_too_large"
    return sse.error_event(
        f"Backend '{exchange.backend}' sent a stream event over the gateway's "
        f"limit ({size} bytes); the response is incomplete.",
        exchange.error,
    )


def _invalid_event(exchange: ProxyExchange) -> bytes:
    return sse.error_event(
        f"Backend '{exchange.backend}' sent a stream event that is not a JSON "
        "object; the response is incomplete.",
        exchange.error,
    )


def _broken_stream(exchange: ProxyExchange, error: BaseException) -> bytes:
    exchange.error = "upstream_stream_broken"
    return sse.error_event(
        _mid_stream(exchange, describe(error)), "upstream_stream_broken"
    )
