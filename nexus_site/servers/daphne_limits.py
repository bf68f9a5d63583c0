"""Limits Daphne enforces on clients before the application runs.

Daphne (Twisted) reads a request's whole body, spooling anything over 100 kB to
a temporary file, and only then starts the ASGI application; the time a client
takes to send its head or body is bounded only by an idle timeout that every
byte resets. So under Daphne:

* **At the headers** (Twisted's ``gotLength()``, called once all headers are
  in and before any body byte is read), ``gateway.proxy.head.refuse_head()``
  decides: an upload to the gateway without a valid client key gets its 401,
  and a ``Content-Length`` over ``NEXUS_MAX_BODY_BYTES`` its 413, in the
  error shape of the path's surface (OpenAI's, Anthropic's on /v1/messages),
  and the connection is closed without reading the body.
* **Ollama model files** (``POST /api/blobs/<digest>``) are refused at the
  headers without a key that may manage models, or over
  ``NEXUS_MAX_BLOB_BYTES``, and have ``NEXUS_BLOB_TIMEOUT`` to arrive. Their
  body is not handed to the application in memory (Daphne would queue all of
  it): the application gets the spooled file (``nexus.transport``'s
  ``body_file``) and streams it on.
* **While the body arrives**, a body sent without a length (chunked) is
  counted and refused with a 413 once it passes the limit. Until then Twisted
  spools it to an (unlinked) temporary file in ``TMPDIR``, not to memory, as
  it does any body over 100 kB; the file is closed at the refusal. A body
  within the limit is then handed to the application in memory, whole.
* **Deadlines**: a request's head must arrive within
  ``NEXUS_CLIENT_HEADER_TIMEOUT`` seconds of the connection opening (or of
  the previous response on a kept-alive connection) and its body within
  ``NEXUS_CLIENT_BODY_TIMEOUT`` seconds after the head; a client dripping
  bytes gets a 408 and is disconnected. An idle kept-alive connection is closed
  quietly after the header timeout.
* **Malformed requests** (a bare CR in a header, a bad request line,
  headers over Twisted's 16 KiB): a 400 (431 for the size) with a JSON error
  in the path's surface shape, where Twisted sends a bare status line.
* **Unsent bytes**: the scope of every request carries the extension
  ``nexus.transport`` with ``unsent_bytes()``, what the connection holds that
  the client has not read yet, so the proxy can cut a stream whose reader
  stalled (Daphne's ``send()`` never waits for the client), and ``abort()``,
  which then closes the connection, dropping what it holds. A response
  handed over whole (or a stream's tail) must be read too: one still unread
  after ``NEXUS_CLIENT_HEADER_TIMEOUT`` is watched, and a client that then
  does not read half of ``NEXUS_STREAM_MAX_UNSENT_BYTES``, or all that is
  left, every ``NEXUS_STREAM_STALL_SECONDS`` is disconnected the same way.
  However a connection ends, what its transport still held is freed at once
  (not when the garbage collector gets to it), and a large buffer's memory is
  given back to the system (``nexus_site.servers.unsent``).

``install_daphne_limits()`` patches Daphne's request and factory classes once
per process; ``nexus_site.servers.serving.prepare_daphne()`` calls it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from gateway.batches import BATCH_PATH_PREFIXES
from gateway.process import Gateway
from gateway.proxy import ProxyApp
from gateway.proxy.errors import ProxyError
from gateway.proxy.head import (
    RequestHead,
    is_blob_upload,
    refuse_head,
    surface_of,
    too_large,
)
from gateway.proxy.surfaces import OPENAI, Surface
from nexus_site.servers.unsent import (
    MemoryRelease,
    abort_connection,
    drop_unsent,
    unsent_bytes,
    unsent_of,
)
from usage import batch_credential

logger = logging.getLogger(__name__)

_DEADLINE = "_nexus_deadline"
_REFUSED = "_nexus_refused"
_RECEIVED = "_nexus_received"
_UNREAD = "_nexus_unread"
_BLOB = "_nexus_blob"


_BATCH_PATHS = tuple(prefix.encode() for prefix in BATCH_PATH_PREFIXES)


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """How much and how slowly a client may send (see the module docstring)."""

    max_body: int
    header_timeout: float
    body_timeout: float
    # And how slowly it may read a response (see watch_unread below).
    max_unsent: int = 1024 * 1024
    stall_seconds: float = 10.0
    # An Ollama model file (POST /api/blobs/<digest>): its size and deadline.
    max_blob: int = 256 * 1024**3
    blob_timeout: float = 3600.0
    # A batch input file or Message Batch (gateway/batches/): its size.
    max_batch: int = 200 * 1024**2

    def max_body_of(self, path: bytes) -> int:
        """The largest body a request to `path` may send (not a model file)."""
        if path.startswith(_BATCH_PATHS):
            return max(self.max_body, self.max_batch)
        return self.max_body

    @classmethod
    def from_settings(cls) -> ClientLimits:
        return cls(
            max_body=settings.NEXUS_MAX_BODY_BYTES,
            header_timeout=settings.NEXUS_CLIENT_HEADER_TIMEOUT,
            body_timeout=settings.NEXUS_CLIENT_BODY_TIMEOUT,
            max_unsent=settings.NEXUS_STREAM_MAX_UNSENT_BYTES,
            stall_seconds=settings.NEXUS_STREAM_STALL_SECONDS,
            max_blob=settings.NEXUS_MAX_BLOB_BYTES,
            blob_timeout=settings.NEXUS_BLOB_TIMEOUT,
            max_batch=settings.NEXUS_BATCH_MAX_FILE_BYTES,
        )


class _SpooledBody:
    """What Daphne reads of an uploaded model file: nothing (see
    ``install_daphne_limits``). The file Twisted spooled the body to is
    handed to the application instead, and closed with this."""

    closed = False

    def __init__(self, spooled: Any) -> None:
        self.spooled = spooled

    def read(self, *args: Any) -> bytes:
        return b""

    def seek(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        self.spooled.close()


class _Discard:
    """A request body sink that keeps nothing (a refused upload)."""

    closed = False

    def write(self, data: bytes) -> None:
        pass

    def seek(self, *args: Any) -> None:
        pass

    def read(self, *args: Any) -> bytes:
        return b""

    def close(self) -> None:
        self.closed = True


def install_daphne_limits(
    gateway: Gateway, proxy: ProxyApp, limits: ClientLimits
) -> None:
    """Patch Daphne's request handling in this process (see the module docstring)."""
    from daphne.http_protocol import HTTPFactory, WebRequest
    from daphne.server import Server
    from twisted.internet import reactor as twisted_reactor
    from twisted.web.http import HTTPChannel

    reactor: Any = twisted_reactor
    release = MemoryRelease(reactor.callLater)

    def arm(channel: Any, seconds: float, what: str) -> None:
        disarm(channel)
        setattr(channel, _DEADLINE, reactor.callLater(seconds, expire, channel, what))

    def disarm(channel: Any) -> None:
        call = getattr(channel, _DEADLINE, None)
        if call is not None:
            setattr(channel, _DEADLINE, None)
            if call.active():
                call.cancel()

    def expire(channel: Any, what: str) -> None:
        setattr(channel, _DEADLINE, None)
        transport = channel.transport
        if transport is None:
            return
        if not channel.requests and unsent_of(transport):
            watch_unread(channel)  # the last response is still being read
            return
        if transport.disconnecting:
            return
        if channel.requests:
            # Part of a request arrived: say why before hanging up.
            logger.info("Client too slow sending its %s; disconnected", what)
            error = ProxyError(
                408,
                f"The request {what} did not arrive in time.",
                code="request_timeout",
            )
            transport.write(_raw_response(error))
        transport.loseConnection()

    def watch_unread(channel: Any) -> None:
        """A response not read within the header timeout: from then on, every
        `stall_seconds` the client must have read half the unsent-bytes
        bound, or all that was left, or it is disconnected and the rest
        dropped. (A stream is held to the bound while it runs,
        gateway/proxy/relays.py; this covers a whole reply, handed over at
        once, and a stream's tail.)
        """
        disarm(channel)
        unread = unsent_of(channel.transport)
        setattr(channel, _UNREAD, unread)
        call = reactor.callLater(limits.stall_seconds, check_unread, channel)
        setattr(channel, _DEADLINE, call)

    def check_unread(channel: Any) -> None:
        setattr(channel, _DEADLINE, None)
        transport = channel.transport
        if transport is None:
            return
        unread = unsent_of(transport)
        if unread == 0:
            if not transport.disconnecting:
                arm(channel, limits.header_timeout, "head")
        elif getattr(channel, _UNREAD) - unread >= limits.max_unsent // 2:
            watch_unread(channel)
        else:
            logger.info("Client stopped reading its response; disconnected")
            transport.abortConnection()
            drop_unsent(transport, release)

    build_protocol = HTTPFactory.buildProtocol

    def build_protocol_with_deadline(self: Any, addr: Any) -> Any:
        protocol = build_protocol(self, addr)
        # Twisted wraps the HTTP/1.1 channel to switch to HTTP/2 if negotiated.
        channel = getattr(protocol, "_channel", protocol)
        arm(channel, limits.header_timeout, "head")
        request_done = channel.requestDone

        def request_done_and_rearm(request: Any) -> None:
            request_done(request)
            transport = channel.transport
            # Also when Twisted closes it after: it first sends what is left.
            if transport is not None and (
                not transport.disconnecting or unsent_of(transport)
            ):
                arm(channel, limits.header_timeout, "head")

        channel.requestDone = request_done_and_rearm
        connection_lost = channel.connectionLost

        def connection_lost_and_disarm(reason: Any) -> None:
            disarm(channel)
            drop_unsent(channel.transport, release)
            connection_lost(reason)
            # These closures refer to the channel: a cycle that would keep it
            # (and what it refers to) until the garbage collector runs.
            channel.__dict__.pop("requestDone", None)
            channel.__dict__.pop("connectionLost", None)

        channel.connectionLost = connection_lost_and_disarm
        return protocol

    HTTPFactory.buildProtocol = build_protocol_with_deadline

    def refuse(request: Any, error: ProxyError, surface: Surface = OPENAI) -> None:
        setattr(request, _REFUSED, True)
        channel = request.channel
        path = getattr(channel, "_path", b"").partition(b"?")[0].decode("latin-1")
        request_id = request.requestHeaders.getRawHeaders(b"x-request-id")
        # Counted like the proxy's own refusals (a request and an error).
        rid = proxy.record_head_refusal(
            error, path, request_id[0] if request_id else None
        )
        # A body sent without a length was spooled to a temporary file (up to
        # the limit): free its disk now, not when the request is collected.
        spooled, request.content = getattr(request, "content", None), _Discard()
        if spooled is not None:
            spooled.close()
        # Twisted would answer "100 Continue" after our refusal otherwise.
        request.requestHeaders.removeHeader(b"Expect")
        disarm(channel)
        transport = channel.transport
        if transport is not None:
            transport.write(_raw_response(error, surface, rid))
            transport.loseConnection()

    got_length = WebRequest.gotLength

    def got_length_or_refuse(self: Any, length: int | None) -> None:
        channel = self.channel
        headers = self.requestHeaders
        authorization = headers.getRawHeaders(b"authorization")
        api_key = headers.getRawHeaders(b"x-api-key")
        state = gateway.snapshots.peek()
        head = RequestHead(
            method=getattr(channel, "_command", b""),
            path=getattr(channel, "_path", b""),
            content_length=length,
            authorization=authorization[0] if authorization else None,
            api_key=api_key[0] if api_key else None,
            batch_credential=headers.hasHeader(batch_credential.HEADER_BYTES),
        )
        policies = None if state is None else state.policies

        def may_manage(prefix: str) -> bool:
            policy = None if policies is None else policies.get(prefix)
            return policy is not None and policy.can_manage_models

        refusal = refuse_head(
            head,
            None if state is None else state.keys,
            auth_required=gateway.config.auth_required,
            max_body=limits.max_body_of(head.path),
            max_blob=limits.max_blob,
            may_manage=may_manage,
        )
        if refusal is not None:
            refuse(self, *refusal)
            return
        setattr(self, _RECEIVED, 0)
        got_length(self, length)
        blob = is_blob_upload(head.method, head.path)
        setattr(self, _BLOB, blob)
        arm(channel, limits.blob_timeout if blob else limits.body_timeout, "body")

    WebRequest.gotLength = got_length_or_refuse

    handle_content_chunk = WebRequest.handleContentChunk

    def handle_counted_chunk(self: Any, data: bytes) -> None:
        if getattr(self, _REFUSED, False):
            return
        received = getattr(self, _RECEIVED, 0) + len(data)
        setattr(self, _RECEIVED, received)
        path = getattr(self.channel, "_path", b"")
        limit = (
            limits.max_blob if getattr(self, _BLOB, False) else limits.max_body_of(path)
        )
        if received > limit:  # sent without a length (chunked)
            refuse(self, too_large(limit), surface_of(path))
            return
        handle_content_chunk(self, data)

    WebRequest.handleContentChunk = handle_counted_chunk

    request_received = WebRequest.requestReceived

    def request_received_unless_refused(self: Any, *args: Any) -> None:
        if getattr(self, _REFUSED, False):
            return
        if self.channel is not None:
            disarm(self.channel)
        request_received(self, *args)

    WebRequest.requestReceived = request_received_unless_refused

    create_application = Server.create_application

    def create_application_with_probe(self: Any, protocol: Any, scope: Any) -> Any:
        extensions = scope.setdefault("extensions", {})
        transport = extensions["nexus.transport"] = {
            "unsent_bytes": functools.partial(unsent_bytes, protocol),
            "abort": functools.partial(abort_connection, protocol, release),
        }
        if getattr(protocol, _BLOB, False) and scope.get("type") == "http":
            # Daphne would put the whole body in the application's queue, in
            # memory, before it runs: a model file of gigabytes. The proxy
            # streams it from the spooled file instead (body_file), and Daphne
            # reads an empty body; the file is closed with the request.
            stand_in = _SpooledBody(protocol.content)
            protocol.content = stand_in
            transport["body_file"] = stand_in.spooled
        return create_application(self, protocol, scope)

    Server.create_application = create_application_with_probe

    def respond_to_bad_request(self: Any, too_large: bool = False) -> None:
        # Twisted's own answer is "400 Bad Request" with no body at all (or,
        # for a line over 16 KiB, none: it hangs up).
        disarm(self)
        error = malformed_request(self, too_large)
        path = getattr(self, "_path", b"")
        self.transport.write(_raw_response(error, surface_of(path)))
        self.loseConnection()

    channel_class: Any = HTTPChannel
    channel_class._respondToBadRequestAndDisconnect = respond_to_bad_request
    channel_class.lineLengthExceeded = lambda self, line: respond_to_bad_request(
        self, too_large=True
    )


def malformed_request(channel: Any, too_large: bool = False) -> ProxyError:
    """The error for a request Twisted's HTTP parser refused (`too_large`: a
    line of it was over Twisted's limit)."""
    if (
        too_large
        or channel._receivedHeaderSize > channel.totalHeadersSize
        or channel._receivedHeaderCount > channel.maxHeaders
    ):
        return ProxyError(
            431,
            f"The request's headers are too large (at most "
            f"{channel.totalHeadersSize // 1024} KiB and {channel.maxHeaders} "
            "headers).",
            code="request_headers_too_large",
        )
    return ProxyError(
        400,
        "The request is not valid HTTP/1.1: its request line, a header or its "
        "chunked body is malformed (for example a bare CR or LF, or a NUL, in a "
        "header; a header name with spaces or without a colon; two lengths).",
        code="malformed_request",
    )


_REASONS = {
    400: b"Bad Request",
    401: b"Unauthorized",
    408: b"Request Timeout",
    413: b"Content Too Large",
    431: b"Request Header Fields Too Large",
}


def _raw_response(
    error: ProxyError, surface: Surface = OPENAI, request_id: str = ""
) -> bytes:
    body = surface.error_body(error)
    head = b"HTTP/1.1 %d %s\r\n" % (error.status, _REASONS.get(error.status, b"Error"))
    head += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    if error.status == 401:
        head += b"www-authenticate: Bearer\r\n"
    if request_id:
        head += b"x-request-id: %s\r\n" % request_id.encode()
    return head + b"connection: close\r\n\r\n" + body
