"""What 1,000 relay workers' heartbeats cost a serving process.

A real Daphne serving Nexus (its database writes counted by a wrapper
installed in it before it starts: tests/db_write_counter.py) and 1,000
simulated workers in this process, each a real WebSocket that registers with
a backend state (one model loaded, its memory, the box's memory) and answers
every ping with a pong carrying the same state, as ``nexus-worker`` does.
The serving process pings them at its heartbeat clock's pace
(gateway/relay/heartbeats.py: 1,000 workers stretch the 5 s interval to 20 s,
50 pings a second). The serving process's CPU time comes from /proc; its
database writes (INSERT, UPDATE, DELETE statements) from the counter.

The issue's bound: 60 s of heartbeats cost under 5 % of one core and fewer
than 100 database writes. The suite runs NEXUS_HEARTBEAT_BENCH_SECONDS (6 s
by default) with 250 workers (NEXUS_HEARTBEAT_BENCH_WORKERS) and a pace of
12.5 pings a second, so that their interval stretches to 20 s as 1,000
workers' does at the default 50 (registering 1,000 took minutes on a loaded
machine); ``make bench-heartbeats`` runs 1,000 workers for the full 60 s, twice: with heartbeats every 5 s (the default) and every 300 s
(none in the run: what 1,000 connected workers cost besides), and appends
the numbers to bench-results/relay-heartbeats.txt.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from backends.models import Worker
from gateway.relay.heartbeats import DEFAULT_HEARTBEATS_PER_SECOND, STRETCH
from nexus_worker import protocol
from tests.conftest import NexusServer, start_nexus_server, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WORKERS = int(os.environ.get("NEXUS_HEARTBEAT_BENCH_WORKERS", "250"))
SECONDS = float(os.environ.get("NEXUS_HEARTBEAT_BENCH_SECONDS", "6"))
# Another heartbeat interval (300: none in the run) measures what 1,000
# connected workers cost the process besides their heartbeats.
INTERVAL = int(os.environ.get("NEXUS_HEARTBEAT_BENCH_INTERVAL", "5"))
# The bounds, for 60 s. Pinged every 5 s (200 pings a second), the
# full run measured 9 % (embedded) and 13 % (production) of a core for the
# whole process on this 2-core machine; with the heartbeat clock's 50 a second
# 4.8 % (production, load 3.9), 1.6 % of it with no heartbeat due. The
# suite's short run, beside the rest of the suite, holds the process to 25 %:
# a snapshot rebuild or database work per heartbeat (three writes each, as
# before) costs several times that; the writes are held to the bound.
CPU_SHARE = 0.05 if SECONDS >= 60 else 0.25
# The pace that stretches WORKERS' interval as far as 1,000's at the default.
PINGS_PER_SECOND = DEFAULT_HEARTBEATS_PER_SECOND * WORKERS / 1000
WRITES_PER_MINUTE = 100
# Workers connecting at once while they register.
CONNECTING = 25
_TICKS = os.sysconf("SC_CLK_TCK")
STATE = protocol.BackendState(
    loaded=(protocol.LoadedModel("m", vram_bytes=4 * 10**9, context_length=8192),),
    memory_bytes=24 * 10**9,
)


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


@pytest.fixture
def counted_server(tmp_path: Path) -> Iterator[tuple[NexusServer, Path]]:
    """Daphne serving Nexus with its database writes counted in a file."""
    count_file = tmp_path / "writes"
    server = start_nexus_server(
        before="import tests.db_write_counter",
        NEXUS_TEST_WRITE_COUNT_FILE=str(count_file),
        NEXUS_RELAY_HEARTBEAT_SECONDS=str(INTERVAL),
        NEXUS_RELAY_HEARTBEATS_PER_SECOND=str(PINGS_PER_SECOND),
    )
    yield server, count_file
    server.stop()


def _writes(count_file: Path) -> int:
    text = count_file.read_text() if count_file.exists() else ""
    return int(text or 0)


class SimulatedWorker:
    """One worker's socket: register, then a pong (with the state) per ping."""

    def __init__(self, name: str, secret: str) -> None:
        self.name = name
        self.secret = secret
        self.pongs = 0

    async def run(
        self, session: aiohttp.ClientSession, url: str, registered: asyncio.Event
    ) -> None:
        async with session.ws_connect(
            f"{url}?name={self.name}", headers={protocol.SECRET_HEADER: self.secret}
        ) as ws:
            register = protocol.Register(
                name=self.name, models=["m"], max_concurrency=4, state=STATE
            )
            await ws.send_str(protocol.encode(register))
            registered.set()
            async for frame in ws:
                message = protocol.decode(frame.data)
                if isinstance(message, protocol.Ping):
                    pong = protocol.Pong(
                        load=0, timestamp=message.timestamp, state=STATE
                    )
                    await ws.send_str(protocol.encode(pong))
                    self.pongs += 1


async def _heartbeat(server: NexusServer, count_file: Path, secrets: list[str]) -> dict:
    url = protocol.websocket_url(server.base_url)
    workers = [SimulatedWorker(f"sim-{i}", s) for i, s in enumerate(secrets)]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = []
        limit = asyncio.Semaphore(CONNECTING)
        for worker in workers:
            async with limit:
                registered = asyncio.Event()
                tasks.append(asyncio.create_task(worker.run(session, url, registered)))
                await asyncio.wait_for(registered.wait(), 30)

        # Every worker registered and its first state written; the
        # snapshots rebuilt: wait for the database to be quiet.
        def connected() -> int:
            return Worker.objects.exclude(channel_name="").count()

        await asyncio.to_thread(
            wait_until, lambda: connected() == WORKERS, 120, "every worker registered"
        )
        await _quiet(count_file)
        pid = server.process.pid
        cpu, writes, pongs = _cpu_seconds(pid), _writes(count_file), _pongs(workers)
        started = time.monotonic()
        await asyncio.sleep(SECONDS)
        elapsed = time.monotonic() - started
        result = {
            "cpu_seconds": _cpu_seconds(pid) - cpu,
            "writes": _writes(count_file) - writes,
            "pongs": _pongs(workers) - pongs,
            "seconds": elapsed,
            "dead": sum(task.done() for task in tasks),
        }
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return result


def _pongs(workers: list[SimulatedWorker]) -> int:
    return sum(worker.pongs for worker in workers)


async def _quiet(count_file: Path, seconds: float = 3.0) -> None:
    """Wait (at most a minute) until no database write came for `seconds`."""
    deadline = time.monotonic() + 60
    last, since = _writes(count_file), time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = _writes(count_file)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= seconds:
            return


# 250 (1,000 in the benchmark) registrations, a database transaction each,
# before the measurement: on a machine loaded by the rest of the suite 1,000
# once outlasted the suite's 240 s.
@pytest.mark.timeout(600)
def test_workers_heartbeating_at_a_stretched_interval_cost_little_cpu_and_few_writes(
    counted_server: tuple[NexusServer, Path],
) -> None:
    server, count_file = counted_server
    secrets = []
    rows = []
    for index in range(WORKERS):
        worker = Worker(name=f"sim-{index}")
        secrets.append(worker.set_new_secret())
        rows.append(worker)
    Worker.objects.bulk_create(rows)

    try:
        result = asyncio.run(_heartbeat(server, count_file, secrets))
    except Exception as error:
        problems = [line for line in server.log if '"WS' not in line]
        raise AssertionError("".join(problems[-40:])) from error

    seconds = result["seconds"]
    summary = (
        f"{WORKERS} workers, {seconds:.1f} s: {result['pongs']} pongs, serving "
        f"process CPU {result['cpu_seconds']:.2f} s "
        f"({100 * result['cpu_seconds'] / seconds:.2f} % of a core), "
        f"{result['writes']} database writes"
    )
    report = os.environ.get("NEXUS_HEARTBEAT_BENCH_REPORT")
    if report:  # make bench-heartbeats: the numbers, with the machine's load
        with open(report, "a") as file:
            file.write(f"{time.strftime('%F %T')} load {os.getloadavg()[0]:.1f}: ")
            file.write(f"interval {INTERVAL} s, {summary}\n")
    assert result["dead"] == 0, f"a worker's socket closed; {summary}"
    # Every worker was pinged and answered about once an interval: 1,000
    # workers stretch the 5 s interval to 20 s (50 pings a second; 250 at 12.5).
    interval = min(max(INTERVAL, WORKERS / PINGS_PER_SECOND), STRETCH * INTERVAL)
    if interval < 60:
        assert result["pongs"] >= 0.8 * WORKERS * seconds / interval, summary
        assert result["pongs"] <= 1.2 * WORKERS * seconds / interval + 100, summary
    assert result["cpu_seconds"] < CPU_SHARE * seconds, summary
    # At least the liveness writes of one period, however short the run.
    assert result["writes"] < max(WRITES_PER_MINUTE * seconds / 60, 10), summary
