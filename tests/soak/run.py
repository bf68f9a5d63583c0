"""``make soak``: one serving process through a series of faults, RSS after each.

Production mode (PostgreSQL and Redis, each reached through a TCP forwarder
the soak cuts for an outage, tests/tcp_cut.py), one Daphne serving process
started as ``nexus_run`` starts it, two mock backends and the hostile one.
Phases, each followed by the serving process's RSS:

1. warm-up traffic;
2. a backend going down and coming back, five times, under traffic; then
   its process killed (SIGKILL) and started again on another port, its row
   moved there (a configuration change every process hears), three times;
3. a backend failing every request until its circuit breaker opens, then
   recovering (three rounds);
4. clients hanging up on streams after their first chunk;
5. a Redis outage, then a PostgreSQL outage, under traffic;
6. the hostile backend's fault catalogue;
7. ``--after`` requests (default 20,000), RSS every 2,000: the growth the
   issue saw after faults would show here.

Then the issue's other goals: the CPU a never-ending upstream event costs and
the latency of other clients meanwhile (against an idle baseline), and the
memory an unauthenticated or oversized upload costs. The report is printed
and written to ``bench-results/soak-<time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.management import call_command
from django.db import connection

from backends.models import Backend, BackendModel, HealthStatus
from nexus_mock import MockBackendProcess, spawn_mock_backend
from tests.hostile_backend import MODES
from tests.tcp_cut import TcpCut
from usage.models import ApiKey
from usage.stream import clear_usage_stream, drain_usage_stream

MODEL = "llama3:8b"
CONCURRENCY = 8
HOSTILE_REPEAT = 5
OUTAGE_SECONDS = 8.0


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Soak:
    """The processes of one soak run and the traffic it sends them."""

    def __init__(self, args: argparse.Namespace, scratch: Path) -> None:
        self.args = args
        self.scratch = scratch
        self.report: dict[str, Any] = {"phases": [], "after_faults": []}
        self.statuses: Counter[int] = Counter()
        self.own_500s = 0
        self.logs: list[Any] = []

    # Setup -----------------------------------------------------------------

    def _spawn_mock(self, letter: str) -> MockBackendProcess:
        """Mock backend soak-a or soak-b (B is killed and started again)."""
        return spawn_mock_backend(
            "--models",
            MODEL,
            "--name",
            f"soak-{letter}",
            "--chunks",
            "8",
            output=self.scratch / f"mock-{letter}.log",
        )

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            self.mock_a = self._spawn_mock("a")
            stack.callback(self.mock_a.stop)
            self.mock_b = self._spawn_mock("b")
            # Killed and started again during the run: stop the current one.
            stack.callback(lambda: self.mock_b.stop())
            self.hostile = spawn_mock_backend(
                "--size",
                str(64 * 1024 * 1024),
                module="tests.hostile_backend",
                output=self.scratch / "hostile.log",
            )
            stack.callback(self.hostile.stop)
            self.key = self._install_rows()
            db = connection.settings_dict
            self.pg_cut = TcpCut((db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)))
            stack.callback(self.pg_cut.close)
            redis_url = urlsplit(settings.REDIS_URL)
            self.redis_cut = TcpCut(
                (redis_url.hostname or "127.0.0.1", redis_url.port or 6379)
            )
            stack.callback(self.redis_cut.close)
            # Members already there (earlier runs' processes), to tell apart.
            self.members_before = _group_members()
            self.server, self.base, self.port = self._start_server(redis_url, "nexus")
            self.servers = [self.server]
            self.bases = [self.base]
            for number in range(self.args.peers):
                # Other serving processes: their channel-layer messages (breaker,
                # usage, configuration) reach the measured one, as in production.
                peer, base, _ = self._start_server(redis_url, f"peer-{number}")
                self.servers.append(peer)
                self.bases.append(base)
            stack.callback(self._stop_servers)
            yield

    def _install_rows(self) -> str:
        Backend.objects.filter(name__startswith="soak-").delete()
        for name, mock in (("soak-a", self.mock_a), ("soak-b", self.mock_b)):
            backend = Backend.objects.create(
                name=name, base_url=mock.base_url, status=HealthStatus.HEALTHY
            )
            BackendModel.objects.create(backend=backend, name=MODEL)
        hostile = Backend.objects.create(
            name="soak-hostile",
            base_url=self.hostile.base_url,
            status=HealthStatus.HEALTHY,
            request_timeout=1.0,
        )
        for mode in MODES:
            BackendModel.objects.create(backend=hostile, name=f"hostile-{mode}")
        _, key = ApiKey.objects.create_key("soak")
        return key

    def _start_server(
        self, redis_url: Any, name: str
    ) -> tuple[subprocess.Popen[str], str, int]:
        db = connection.settings_dict
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        env = dict(os.environ)
        env.update(
            DATABASE_URL=(
                f"postgres://{db['USER']}@127.0.0.1:{self.pg_cut.port}/{db['NAME']}"
            ),
            REDIS_URL=redis_url._replace(
                netloc=f"127.0.0.1:{self.redis_cut.port}"
            ).geturl(),
            NEXUS_ACCESS_LOG="0",
            NEXUS_BREAKER_COOLDOWN="2",
            NEXUS_STATE_DIR=str(self.scratch / "state"),
            LOG_LEVEL="WARNING",
        )
        log = (self.scratch / f"{name}.log").open("w")
        self.logs.append(log)
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nexus_site.servers.daphne_main",
                "-b",
                "127.0.0.1",
                "-p",
                str(port),
                "nexus_site.asgi:application",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            # Another checkout's code (an older version, to compare) if asked.
            cwd=self.args.server_tree or settings.BASE_DIR,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if (
                    httpx.get(
                        f"{base}/v1/models", headers=self._headers, timeout=2
                    ).status_code
                    == 200
                ):
                    return process, base, port
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("Nexus did not start; see " + str(log.name))
            time.sleep(0.2)

    def _stop_servers(self) -> None:
        for server in self.servers:
            server.terminate()
        for server in self.servers:
            try:
                server.wait(timeout=40)
            except subprocess.TimeoutExpired:
                server.kill()
        for log in self.logs:
            log.close()

    @property
    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {getattr(self, 'key', '')}"}

    # Traffic ---------------------------------------------------------------

    async def traffic(self, count: int, model: str = MODEL) -> None:
        """`count` requests, CONCURRENCY at a time: chat, streamed chat, models."""
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(
            headers=self._headers, timeout=30, limits=limits
        ) as client:
            queue = iter(range(count))

            async def worker() -> None:
                for index in queue:
                    await self._one(client, index, model)

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

    async def _one(self, client: httpx.AsyncClient, index: int, model: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": f"n{index}"}]}
        # Half to the measured process, the rest spread over the peers.
        bases = self.bases
        base = bases[0] if index % 2 == 0 else bases[(index // 2) % len(bases)]
        try:
            if index % 10 == 9:
                response = await client.get(f"{base}/v1/models")
            elif index % 5 == 0:
                async with client.stream(
                    "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}
                ) as response:
                    async for _ in response.aiter_bytes():
                        pass
            else:
                response = await client.post(f"{base}/v1/chat/completions", json=body)
        except httpx.HTTPError:
            self.statuses[0] += 1
            return
        self.statuses[response.status_code] += 1
        if response.status_code == 500 and "x-nexus-backend" not in response.headers:
            self.own_500s += 1

    def rss(self, phase: str) -> int:
        rss = _rss_kib(self.server.pid)
        peers = [_rss_kib(server.pid) for server in self.servers[1:]]
        self.report["phases"].append(
            {"phase": phase, "rss_kib": rss, "peers_rss_kib": peers}
        )
        shown = "".join(f" / peer {peer / 1024:.1f}" for peer in peers)
        _say(f"{phase:<44} RSS {rss / 1024:7.1f} MiB{shown}")
        return rss

    def drain_usage(self) -> None:
        with contextlib.suppress(Exception):
            drain_usage_stream()

    # Phases ----------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        await self.traffic(2000)
        self.drain_usage()
        self.rss("1. warm-up (2,000 requests)")
        for _ in range(5):
            _mock(self.mock_a, refuse_for_ms=1000)
            await self.traffic(300)
            await asyncio.sleep(1.0)
        self.rss("2. a backend down and back, 5 times")
        for _ in range(3):
            await self._kill_and_restart_backend()
        self.rss("2b. a backend killed, restarted on a new port, 3x")
        for _ in range(3):
            _mock(self.mock_a, fail_status=500, error_rate=1.0)
            await self.traffic(300)
            _mock_reset(self.mock_a)
            await asyncio.sleep(2.5)  # the cool-down
            await self.traffic(300)
        self.rss("3. breaker opened and closed, 3 times")
        _mock(self.mock_a, chunk_delay_ms=50)
        _mock(self.mock_b, chunk_delay_ms=50)
        await self._aborted_streams(300)
        _mock_reset(self.mock_a)
        _mock_reset(self.mock_b)
        self.rss("4. 300 clients hanging up mid-stream")
        self.redis_cut.cut()
        await self._traffic_for(self.args.outage)
        self.redis_cut.restore()
        await self.traffic(1000)
        self.rss("5a. Redis outage under traffic")
        self.pg_cut.cut()
        await self._traffic_for(self.args.outage)
        self.pg_cut.restore()
        await asyncio.sleep(2)
        await self.traffic(1000)
        self.drain_usage()
        self.rss("5b. PostgreSQL outage under traffic")
        if not self.args.no_hostile:
            for _ in range(HOSTILE_REPEAT):
                for mode in MODES:
                    await self.traffic(2, model=f"hostile-{mode}")
            self.rss(f"6. hostile catalogue ({HOSTILE_REPEAT} rounds)")
        self.report["group_members"] = members = _group_members()
        _say(
            f"channel-layer group members after the faults: {members} (before "
            f"the run: {self.members_before}, left by earlier runs' processes)"
        )
        after = self.args.after
        for done in range(2000, after + 1, 2000):
            await self.traffic(2000)
            self.drain_usage()
            rss = _rss_kib(self.server.pid)
            peers = [_rss_kib(server.pid) for server in self.servers[1:]]
            self.report["after_faults"].append(
                {"requests": done, "rss_kib": rss, "peers_rss_kib": peers}
            )
            _say(
                f"7. after the faults: {done:>6} requests       RSS "
                f"{rss / 1024:7.1f} MiB"
            )
        if not self.args.no_hostile:
            self.report["never_ending_event"] = await self._never_ending_event()
            self.report["uploads"] = self._uploads()
        self.report["statuses"] = dict(self.statuses)
        self.report["own_500s"] = self.own_500s
        return self.report

    async def _kill_and_restart_backend(self) -> None:
        """SIGKILL mock B under traffic, start it again on another port and
        move its row there (a configuration change every process hears)."""
        await asyncio.sleep(2.5)  # A's breaker closed again (the cool-down)
        self.mock_b.process.kill()
        self.mock_b.process.wait()
        await self.traffic(300)
        self.mock_b = self._spawn_mock("b")
        await sync_to_async(_move_backend)("soak-b", self.mock_b.base_url)
        await self.traffic(300)

    async def _traffic_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await self.traffic(100)

    async def _aborted_streams(self, count: int) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
        }
        async with httpx.AsyncClient(
            base_url=self.base, headers=self._headers, timeout=30
        ) as client:
            for _ in range(count // CONCURRENCY):

                async def one() -> None:
                    async with client.stream(
                        "POST", "/v1/chat/completions", json=body
                    ) as response:
                        async for _ in response.aiter_bytes():
                            break  # hang up after the first chunk

                await asyncio.gather(*(one() for _ in range(CONCURRENCY)))

    async def _models_latency(self, count: int = 300) -> float:
        samples = []
        async with httpx.AsyncClient(
            base_url=self.base, headers=self._headers, timeout=10
        ) as client:
            for _ in range(count):
                start = time.perf_counter()
                await client.get("/v1/models")
                samples.append((time.perf_counter() - start) * 1000)
        return statistics.median(samples)

    async def _never_ending_event(self) -> dict[str, Any]:
        idle = await self._models_latency()
        stop = asyncio.Event()
        requests = 0

        async def endless() -> None:
            nonlocal requests
            body = {
                "model": "hostile-endless-event",
                "stream": True,
                "messages": [{"role": "user", "content": "x"}],
            }
            async with httpx.AsyncClient(
                base_url=self.base, headers=self._headers, timeout=30
            ) as client:
                while not stop.is_set():
                    await client.post("/v1/chat/completions", json=body)
                    requests += 1

        cpu_before = _cpu_seconds(self.server.pid)
        started = time.monotonic()
        task = asyncio.create_task(endless())
        busy = await self._models_latency()
        stop.set()
        await task
        elapsed = time.monotonic() - started
        cpu = _cpu_seconds(self.server.pid) - cpu_before
        result = {
            "models_median_ms_idle": round(idle, 2),
            "models_median_ms_beside_endless_events": round(busy, 2),
            "endless_event_requests": requests,
            "server_cpu_ms_per_endless_event": round(cpu * 1000 / max(requests, 1), 1),
            "seconds": round(elapsed, 1),
        }
        _say(f"never-ending events: {result}")
        return result

    def _uploads(self) -> dict[str, Any]:
        """Ten 256 MiB uploads without a key, ten with a key declaring more
        than the limit, and ten with a key sent chunked (no length)."""
        before = _rss_kib(self.server.pid)
        spool = self.scratch / "state"
        results: dict[str, Any] = {}
        cases = (
            ("no_key", None, False),
            ("over_limit", self.key, False),
            ("chunked_with_key", self.key, True),
        )
        for label, key, chunked in cases:
            sent = []
            for _ in range(10):
                sent.append(_upload(self.port, 256 * 1024 * 1024, key, chunked))
            results[label] = {
                "statuses": sorted({s for s, _ in sent}),
                "body_bytes_sent_max": max(b for _, b in sent),
            }
        results["rss_growth_kib"] = _rss_kib(self.server.pid) - before
        results["temp_files"] = len(list(Path("/tmp").glob("tmp*")))
        del spool
        _say(f"uploads: {results}")
        return results


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _upload(
    port: int, size: int, key: str | None, chunked: bool = False
) -> tuple[int, int]:
    """Declare `size` bytes (or send them chunked) and send as much as the
    server takes; return the status and the bytes sent."""
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/json\r\n"
        f"{length}\r\n" + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n"
    ).encode()
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        chunk = b"x" * 65536
        if chunked:
            chunk = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        with contextlib.suppress(OSError):
            sock.settimeout(0.5)
            while sent < size:
                sent += sock.send(chunk)
        sock.settimeout(10)
        data = b""
        with contextlib.suppress(OSError):
            while part := sock.recv(65536):
                data += part
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, sent


def _group_members() -> dict[str, int]:
    """Members of the serving processes' channel-layer groups (one per process
    and group; more are channels an outage left behind)."""
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        counts: dict[str, Any] = {
            group: client.zcard(f"asgi:group:{group}")
            for group in ("nexus.breaker", "nexus.config", "nexus.usage")
        }
        return {group: int(count) for group, count in counts.items()}
    finally:
        client.close()


def _move_backend(name: str, base_url: str) -> None:
    backend = Backend.objects.get(name=name)
    backend.base_url = base_url
    backend.save()  # the configuration change is announced to every process


def _mock(process: MockBackendProcess, **knobs: object) -> None:
    httpx.post(f"{process.base_url}/_mock/config", json=knobs, timeout=5)


def _mock_reset(process: MockBackendProcess) -> None:
    deadline = time.monotonic() + 5
    while True:
        try:
            httpx.post(f"{process.base_url}/_mock/reset", timeout=5)
            return
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--after",
        type=int,
        default=20_000,
        help="requests after the faults (RSS every 2,000)",
    )
    parser.add_argument(
        "--peers",
        type=int,
        default=1,
        help="other serving processes beside the measured one (default 1)",
    )
    parser.add_argument(
        "--outage",
        type=float,
        default=OUTAGE_SECONDS,
        help="seconds each of the Redis and PostgreSQL outages lasts",
    )
    parser.add_argument(
        "--server-tree",
        help="serve from this checkout instead (e.g. an older version, to compare)",
    )
    parser.add_argument(
        "--no-hostile",
        action="store_true",
        help="skip the hostile backend's faults and the upload and endless-event "
        "measurements (for a version without their limits)",
    )
    args = parser.parse_args(argv)
    if connection.vendor != "postgresql" or not settings.REDIS_URL:
        _say("make soak needs production mode (DATABASE_URL, REDIS_URL)")
        return 2
    call_command("migrate", verbosity=0)
    clear_usage_stream()
    out = Path(settings.BASE_DIR) / "bench-results"
    out.mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        import tempfile

        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory("-soak")))
        soak = Soak(args, scratch)
        stack.enter_context(soak.running())
        report = asyncio.run(soak.run())
        report["log_tail"] = (scratch / "nexus.log").read_text()[-4000:]
    path = out / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    _say(f"statuses: {report['statuses']}; own 500s: {report['own_500s']}")
    _say(f"report: {path}")
    return 0
