"""Parsing of HTTP/1.1 requests for the mock backend's protocol (RFC 9112)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(slots=True)
class Request:
    """One parsed HTTP request. Header names are lower-case."""

    method: str
    target: str
    path: str
    version: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class ProtocolError(Exception):
    """The client broke HTTP; answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class RequestHead:
    """The parsed request line and headers, before the body has arrived."""

    method: str
    target: str
    path: str
    version: str
    headers: dict[str, str]
    content_length: int
    chunked: bool
    keep_alive: bool
    expects_continue: bool


def parse_head(raw: bytes) -> RequestHead:
    """Parse a request head (without its final blank line); raise ProtocolError."""
    text = raw.decode("latin-1")
    lines = text.split("\r\n")
    # A lone CR or LF could smuggle a header into anything we echo back.
    breaks = len(lines) - 1
    if text.count("\r") != breaks or text.count("\n") != breaks:
        raise ProtocolError(400, "Bare CR or LF in the request head.")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[0].isupper():
        raise ProtocolError(400, "Malformed HTTP request line.")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        if version.startswith("HTTP/"):
            raise ProtocolError(505, f"{version} is not supported; use HTTP/1.1.")
        raise ProtocolError(400, "Malformed HTTP request line.")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or " " in name or "\t" in name:
            raise ProtocolError(400, f"Malformed HTTP header line: {line[:100]!r}.")
        name = name.lower()
        value = value.strip(" \t")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    path = _parse_target(target)
    content_length = 0
    chunked = False
    if "transfer-encoding" in headers:
        if "content-length" in headers:
            raise ProtocolError(
                400, "A request cannot have both Content-Length and Transfer-Encoding."
            )
        if headers["transfer-encoding"].lower() != "chunked":
            raise ProtocolError(501, "Only chunked transfer encoding is supported.")
        chunked = True
    elif "content-length" in headers:
        content_length = _parse_content_length(headers["content-length"])
    connection = headers.get("connection", "").lower()
    if version == "HTTP/1.1":
        keep_alive = "close" not in connection
    else:
        keep_alive = "keep-alive" in connection
    return RequestHead(
        method=method,
        target=target,
        path=path,
        version=version,
        headers=headers,
        content_length=content_length,
        chunked=chunked,
        keep_alive=keep_alive,
        expects_continue=version == "HTTP/1.1"
        and headers.get("expect", "").lower() == "100-continue",
    )


def _parse_target(target: str) -> str:
    if not target.startswith("/"):
        if not target.startswith(("http://", "https://")):
            raise ProtocolError(400, f"Malformed request target {target[:100]!r}.")
        target = urlsplit(target).path or "/"
    path = target.partition("?")[0]
    return unquote(path) if "%" in path else path


def _parse_content_length(value: str) -> int:
    text = value
    if "," in value:
        # Repeated headers were joined with ", "; they must all agree.
        values = {item.strip() for item in value.split(",")}
        if len(values) != 1:
            raise ProtocolError(400, "Conflicting Content-Length headers.")
        text = values.pop()
    if not text.isascii() or not text.isdigit():
        raise ProtocolError(400, f"Invalid Content-Length {text[:40]!r}.")
    length = int(text)
    if length > MAX_BODY_BYTES:
        raise ProtocolError(413, f"The request body exceeds {MAX_BODY_BYTES} bytes.")
    return length


def decode_chunked(buffer: bytearray) -> tuple[bytes, int] | None:
    """Decode a chunked body at the start of ``buffer``; None if incomplete."""
    parts: list[bytes] = []
    total = 0
    position = 0
    while True:
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            if len(buffer) - position > 1024:
                raise ProtocolError(400, "Malformed chunk size line.")
            return None
        size_text = bytes(buffer[position:line_end]).split(b";", 1)[0].strip()
        if not size_text or not all(c in b"0123456789abcdefABCDEF" for c in size_text):
            raise ProtocolError(400, "Malformed chunk size line.")
        size = int(size_text, 16)
        if size == 0:
            # Skip any trailer fields up to the blank line that ends the body.
            end = buffer.find(b"\r\n\r\n", line_end)
            if end < 0:
                return None
            return b"".join(parts), end + 4
        data_start = line_end + 2
        data_end = data_start + size
        total += size
        if total > MAX_BODY_BYTES:
            raise ProtocolError(
                413, f"The request body exceeds {MAX_BODY_BYTES} bytes."
            )
        if len(buffer) < data_end + 2:
            return None
        if buffer[data_end : data_end + 2] != b"\r\n":
            raise ProtocolError(400, "Malformed chunked body.")
        parts.append(bytes(buffer[data_start:data_end]))
        position = data_end + 2
