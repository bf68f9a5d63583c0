"""The benchmark's clients: wrk for throughput, small raw-socket probes for latency.

wrk (a C load generator) measures requests per second. Its latency percentiles
are not used: Debian's wrk 4.1 adds synthetic samples after every slow request
(coordinated-omission correction), which inflates them several-fold against a
server that stalls now and then. Latency comes from raw per-request samples
taken by a probe client written here on plain asyncio streams (no HTTP
library between the clock and the wire; uvloop), which also times the first
SSE ``data:`` line of streams (time to first byte).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from collections.abc import Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# wrk prints this JSON line from the Lua `done` hook; everything else it prints
# (its corrected latency table) is ignored.
_WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = {body}
{headers}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\n{{"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,'
    .. '"write":%d,"status":%d,"timeout":%d}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read,
    e.write, e.status, e.timeout))
end
"""


class BenchError(Exception):
    """The benchmark could not measure something (a server failed, a bad reply)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One HTTP endpoint to load, with the exact request bytes every client sends."""

    host: str
    port: int
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def keyed(
        cls,
        base_url: str,
        path: str,
        body: bytes,
        key: str,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> Endpoint:
        """``path`` at a server's ``base_url``, sent with a client key."""
        parts = urlsplit(base_url)
        assert parts.hostname is not None and parts.port is not None
        auth = ("Authorization", f"Bearer {key}")
        return cls(parts.hostname, parts.port, path, body, (auth, *headers))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.path}"

    def request_bytes(self) -> bytes:
        lines = [
            f"POST {self.path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Content-Type: application/json",
            f"Content-Length: {len(self.body)}",
            *(f"{name}: {value}" for name, value in self.headers),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


@dataclass(slots=True)
class Samples:
    """Raw per-request timings (nanoseconds) from one client run."""

    latencies_ns: list[int] = field(default_factory=list)
    first_bytes_ns: list[int] = field(default_factory=list)
    errors: int = 0
    elapsed_s: float = 0.0
    max_lag_ns: int = 0  # paced clients: the latest a request started

    @property
    def count(self) -> int:
        return len(self.latencies_ns)


@dataclass(frozen=True, slots=True)
class WrkResult:
    """What wrk counted in one run (its latency figures are deliberately absent)."""

    requests: int
    duration_s: float
    errors: int
    bytes_read: int

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


class _SocketReader:
    """Read HTTP/1.1 responses off a blocking keep-alive socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def _fill(self) -> None:
        chunk = self._sock.recv(65536)
        if not chunk:
            raise BenchError("the server closed the connection")
        self._buffer += chunk

    def _take_until(self, marker: bytes) -> bytes:
        while (end := self._buffer.find(marker)) < 0:
            self._fill()
        data = bytes(self._buffer[: end + len(marker)])
        del self._buffer[: end + len(marker)]
        return data

    def _take(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._fill()
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def read_response(self) -> Response:
        status, headers = _parse_head(self._take_until(b"\r\n\r\n"))
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            parts = []
            while size := int(self._take_until(b"\r\n").split(b";")[0], 16):
                parts.append(self._take(size + 2)[:-2])
            self._take_until(b"\r\n")  # no trailers are expected
            body = b"".join(parts)
        else:
            body = self._take(int(headers.get(b"content-length", b"0")))
        return Response(status, headers, body)


def _parse_head(head: bytes) -> tuple[int, dict[bytes, bytes]]:
    status_line, *lines = head[:-4].split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split(b" ", 2)[1]), headers


def fetch_once(endpoint: Endpoint, timeout: float = 10.0) -> Response:
    """Send one request on a fresh connection and return the whole response."""
    with socket.create_connection((endpoint.host, endpoint.port), timeout) as sock:
        sock.sendall(endpoint.request_bytes())
        return _SocketReader(sock).read_response()


def measure_concurrently(
    endpoint: Endpoint,
    connections: int,
    duration: float,
    cpus: Collection[int] | None = None,
    *,
    expect: bytes,
) -> Samples:
    """Run ``connections`` keep-alive connections that send requests back to back.

    Records, per request, the time from the request written to the first body
    bytes (for a stream: the first chunk holding an SSE ``data:`` line, its time
    to first byte) and to the last byte. A reply other than 200, or without
    ``expect`` in its body, counts as an error.
    """
    previous = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        return _run_loop(_measure_concurrently(endpoint, connections, duration, expect))
    finally:
        os.sched_setaffinity(0, previous)


def _run_loop(coroutine: Coroutine[Any, Any, Samples]) -> Samples:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency everywhere but Windows
        factory = None
    else:
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coroutine)


async def _measure_concurrently(
    endpoint: Endpoint, connections: int, duration: float, expect: bytes
) -> Samples:
    samples = Samples()
    started = time.perf_counter_ns()
    deadline = started + int(duration * 1e9)
    await asyncio.gather(
        *(
            _send_back_to_back(endpoint, deadline, samples, expect)
            for _ in range(connections)
        )
    )
    samples.elapsed_s = (time.perf_counter_ns() - started) / 1e9
    return samples


async def _send_back_to_back(
    endpoint: Endpoint, deadline: int, samples: Samples, expect: bytes
) -> None:
    request = endpoint.request_bytes()
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    try:
        # At least one request, however late the connection opened: a loaded
        # server may take the whole (short) run to accept it, and a figure
        # with no sample at all is no figure.
        while True:
            _record(samples, await _exchange(reader, writer, request), expect)
            if time.perf_counter_ns() >= deadline:
                break
    finally:
        writer.close()


@dataclass(frozen=True, slots=True)
class _Exchange:
    status: int
    body: bytes
    begin_ns: int
    first_ns: int  # first body bytes (of a stream: the first SSE data line)
    end_ns: int


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> _Exchange:
    """Send one request on a keep-alive connection and time its response."""
    clock = time.perf_counter_ns
    begin = clock()
    writer.write(request)
    status, headers = _parse_head(await reader.readuntil(b"\r\n\r\n"))
    first = 0
    body = bytearray()
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while size := int((await reader.readline()).split(b";")[0], 16):
            body += (await reader.readexactly(size + 2))[:-2]
            if not first and b"data:" in body:
                first = clock()
        await reader.readline()
    else:
        body += await reader.readexactly(int(headers.get(b"content-length", b"0")))
        first = clock()
    return _Exchange(status, bytes(body), begin, first or clock(), clock())


def _record(samples: Samples, exchange: _Exchange, expect: bytes) -> None:
    if exchange.status != 200 or expect not in exchange.body:
        samples.errors += 1
        return
    samples.first_bytes_ns.append(exchange.first_ns - exchange.begin_ns)
    samples.latencies_ns.append(exchange.end_ns - exchange.begin_ns)


def measure_paced(
    endpoint: Endpoint,
    rate: float,
    duration: float,
    cpus: Collection[int] | None = None,
    *,
    expect: bytes,
) -> Samples:
    """Send ``rate`` requests per second for ``duration`` seconds, on schedule.

    Open loop: each request starts at its scheduled time whether or not earlier
    ones have finished, on an idle keep-alive connection (a new one when all are
    busy). Records the same times as ``measure_concurrently``, and how far
    behind schedule the client fell (``max_lag_ns``), which says whether the
    offered rate was really offered.
    """
    previous = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        return _run_loop(_measure_paced(endpoint, rate, duration, expect))
    finally:
        os.sched_setaffinity(0, previous)


async def _measure_paced(
    endpoint: Endpoint, rate: float, duration: float, expect: bytes
) -> Samples:
    samples = Samples()
    request = endpoint.request_bytes()
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    opened: list[asyncio.StreamWriter] = []

    async def send_one() -> None:
        if idle:
            reader, writer = idle.pop()
        else:
            reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
            opened.append(writer)
        try:
            exchange = await _exchange(reader, writer, request)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            samples.errors += 1
            writer.close()
            return
        _record(samples, exchange, expect)
        idle.append((reader, writer))

    # A connection ready before the clock starts, as a client's pool would have.
    idle.append(await asyncio.open_connection(endpoint.host, endpoint.port))
    opened.append(idle[0][1])
    clock = time.perf_counter_ns
    interval = 1e9 / rate
    started = clock()
    tasks = []
    try:
        for number in range(max(1, int(duration * rate))):
            due = started + int(number * interval)
            if (wait := due - clock()) > 0:
                await asyncio.sleep(wait / 1e9)
            samples.max_lag_ns = max(samples.max_lag_ns, clock() - due)
            tasks.append(asyncio.create_task(send_one()))
        await asyncio.gather(*tasks)
    finally:
        for writer in opened:
            writer.close()
    samples.elapsed_s = (clock() - started) / 1e9
    return samples


def write_wrk_script(directory: Path, endpoint: Endpoint, name: str) -> Path:
    """Write the Lua script that makes wrk send ``endpoint``'s request."""
    headers = "\n".join(
        f"wrk.headers[{_lua_string(k)}] = {_lua_string(v)}"
        for k, v in (("Content-Type", "application/json"), *endpoint.headers)
    )
    path = directory / f"{name}.lua"
    path.write_text(
        _WRK_SCRIPT.format(body=_lua_string(endpoint.body.decode()), headers=headers)
    )
    return path


def _lua_string(text: str) -> str:
    # A JSON string literal is a valid Lua string literal for ASCII text.
    return json.dumps(text, ensure_ascii=True)


def start_wrk(
    wrk: str,
    endpoint: Endpoint,
    script: Path,
    connections: int,
    duration: float,
    pin_prefix: Sequence[str] = (),
) -> subprocess.Popen[str]:
    """Start wrk against ``endpoint``; collect its result with ``finish_wrk``."""
    argv = [
        *pin_prefix,
        wrk,
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        endpoint.url,
    ]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish_wrk(process: subprocess.Popen[str]) -> WrkResult:
    """Wait for wrk and read the summary its Lua ``done`` hook printed."""
    try:
        output, _ = process.communicate(timeout=600)
    except BaseException:
        process.kill()
        process.wait()
        raise
    for line in reversed(output.splitlines()):
        if line.startswith('{"requests"'):
            data = json.loads(line)
            return WrkResult(
                requests=data["requests"],
                duration_s=data["duration_us"] / 1e6,
                errors=sum(
                    data[k] for k in ("connect", "read", "write", "status", "timeout")
                ),
                bytes_read=data["bytes"],
            )
    raise BenchError(f"wrk exited {process.returncode} without a summary:\n{output}")
