"""Run the benchmark: the same load straight at the mock, then through Nexus.

One mock backend serves every run. It is measured directly first (the limit),
then each serving process (Daphne, then uvicorn, on the same ASGI application)
is started alone, warmed up, and measured with the same clients. Nothing runs
in parallel except the load generators of one measurement.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings

from tests.bench.clients import (
    BenchError,
    Endpoint,
    fetch_once,
    finish_wrk,
    measure_concurrently,
    start_wrk,
    write_wrk_script,
)
from tests.bench.database import (
    BACKEND_NAME,
    MODEL,
    describe_settings,
    install_bench_rows,
)
from tests.bench.processes import (
    SERVERS,
    Child,
    Pinning,
    pin_prefix,
    plan_pinning,
    start_mock,
    start_server,
    version_of,
)
from tests.bench.report import build_report, summarize_ns

# A small but realistic chat request; the mock's reply is about 350 bytes.
CHAT_BODY = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Say hello to the benchmark."},
    ],
    "max_tokens": 64,
    "temperature": 0.2,
}
CHAT_REPLY = b'"choices"'
STREAM_END = b"data: [DONE]"
# At concurrency c > 1, c / PROBE_SHARE connections are latency probes.
PROBE_SHARE = 4
# Time for wrk's connections to open before the probe starts timing, and for
# the probe to stop before wrk does, so the probe only sees full load.
_EDGE_SECONDS = 0.3

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What to measure and for how long."""

    duration: int = 10  # seconds per measurement
    warmup: float = 3.0  # seconds of load before a target's first measurement
    servers: tuple[str, ...] = SERVERS
    concurrency: tuple[int, ...] = (1, 16, 64)
    # Back-to-back streams keep the server busy, so at 8 the time to first byte
    # includes waiting behind the other 7; 1 shows the overhead alone.
    stream_concurrency: tuple[int, ...] = (1, 8)
    stream_chunks: int = 16
    pin: bool = True
    profile_dir: Path | None = None  # where py-spy profiles go; None: no profiling
    wrk: str = "wrk"


@dataclass
class _Target:
    """One thing to measure: the mock itself, or Nexus in front of it."""

    label: str
    chat: Endpoint
    stream: Endpoint
    load_cpus: frozenset[int]
    watched: dict[str, Child] = field(default_factory=dict)


def run_benchmark(
    options: BenchOptions, env: dict[str, str], progress: Progress
) -> dict[str, Any]:
    """Measure the mock directly and through each serving process; return the report.

    Needs a migrated database; adds a backend, a model and a client key for the
    run and removes them afterwards. Raises BenchError when something cannot be
    measured.
    """
    wrk = shutil.which(options.wrk)
    if wrk is None:
        raise BenchError(
            f"The load generator {options.wrk!r} is not installed "
            "(Debian: apt-get install wrk)."
        )
    pinning = plan_pinning(options.pin)
    loadavg_start = os.getloadavg()
    started_at = time.time()
    cwd = Path(settings.BASE_DIR)
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory("-bench")))
        mock = start_mock(
            env,
            cwd,
            scratch,
            pinning.mock,
            name=BACKEND_NAME,
            model=MODEL,
            chunks=options.stream_chunks,
        )
        stack.callback(mock.stop)
        key = stack.enter_context(install_bench_rows(mock.url))
        runner = _Runner(options, wrk, pinning, scratch, progress)
        direct = _Target(
            "direct",
            *_endpoints(mock.url, {}),
            load_cpus=pinning.load_direct,
            watched={"mock": mock},
        )
        progress(f"Mock backend at {mock.url}; measuring it directly")
        results["direct"] = runner.measure(direct)
        auth = {"Authorization": f"Bearer {key}"}
        for kind in options.servers:
            progress(f"Starting Nexus under {kind}")
            server = start_server(kind, env, cwd, scratch, pinning.server, auth)
            try:
                target = _Target(
                    kind,
                    *_endpoints(server.url, auth),
                    load_cpus=pinning.load_via_nexus,
                    watched={"server": server, "mock": mock},
                )
                results[kind] = runner.measure(target)
                if options.profile_dir is not None:
                    results[kind]["profile"] = runner.profile(target, server)
            finally:
                server.stop()
    return build_report(
        results,
        options=options,
        started_at=started_at,
        environment={
            "cpus": os.cpu_count(),
            "loadavg_start": [round(x, 2) for x in loadavg_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "python": _python_version(),
            "daphne": version_of("daphne"),
            "uvicorn": version_of("uvicorn"),
            "wrk": _wrk_version(wrk),
            "settings": describe_settings(),
            "pinning": pinning.describe(),
        },
    )


class _Runner:
    def __init__(
        self,
        options: BenchOptions,
        wrk: str,
        pinning: Pinning,
        scratch: Path,
        progress: Progress,
    ) -> None:
        self.options = options
        self.wrk = wrk
        self.pinning = pinning
        self.scratch = scratch
        self.progress = progress

    def measure(self, target: _Target) -> dict[str, Any]:
        """Check, warm up, then measure chat at each concurrency and streaming."""
        _check_replies(target)
        chat_script = write_wrk_script(
            self.scratch, target.chat, f"{target.label}-chat"
        )
        stream_script = write_wrk_script(
            self.scratch, target.stream, f"{target.label}-stream"
        )
        self._warm_up(target, chat_script)
        result: dict[str, Any] = {"chat": {}, "stream": {}}
        server = target.watched.get("server")
        if server is not None:
            result["rss_after_warmup_kib"] = server.memory_kib()["VmRSS"]
        for concurrency in self.options.concurrency:
            self.progress(f"  {target.label}: chat, {concurrency} connections")
            result["chat"][str(concurrency)] = self._measure_chat(
                target, chat_script, concurrency
            )
        for concurrency in self.options.stream_concurrency:
            self.progress(f"  {target.label}: streaming, {concurrency} connections")
            result["stream"][str(concurrency)] = self._measure_stream(
                target, stream_script, concurrency
            )
        if server is not None:
            server.check_alive()
            memory = server.memory_kib()
            result["rss_end_kib"] = memory["VmRSS"]
            result["peak_rss_kib"] = memory["VmHWM"]
            result["pid"] = server.pid
        return result

    def _warm_up(self, target: _Target, chat_script: Path) -> None:
        if self.options.warmup <= 0:
            return
        self.progress(f"  {target.label}: warming up for {self.options.warmup:g} s")
        wrk = start_wrk(
            self.wrk,
            target.chat,
            chat_script,
            16,
            max(1.0, self.options.warmup),
            pin_prefix(target.load_cpus),
        )
        finish_wrk(wrk)
        measure_concurrently(
            target.stream, 4, min(1.0, self.options.warmup), expect=STREAM_END
        )

    def _measure_chat(
        self, target: _Target, script: Path, concurrency: int
    ) -> dict[str, Any]:
        duration = self.options.duration
        cpus = target.load_cpus
        if concurrency == 1:
            # Throughput and latency from separate runs: a second connection
            # would double the concurrency being measured.
            with _cpu_usage(target.watched, duration) as cpu:
                wrk = finish_wrk(
                    start_wrk(
                        self.wrk, target.chat, script, 1, duration, pin_prefix(cpus)
                    )
                )
            probe = measure_concurrently(
                target.chat, 1, duration, cpus, expect=CHAT_REPLY
            )
            rate = wrk.requests_per_s
            source = "1 probe connection alone (after wrk's run)"
        else:
            # A quarter of the connections are the probe's, the rest wrk's: the
            # probe sees the same queue as every other client, and enough of
            # its replies to give a p99.
            probes = max(1, concurrency // PROBE_SHARE)
            with _cpu_usage(target.watched, duration) as cpu:
                process = start_wrk(
                    self.wrk,
                    target.chat,
                    script,
                    concurrency - probes,
                    duration,
                    pin_prefix(cpus),
                )
                try:
                    time.sleep(_EDGE_SECONDS)
                    probe = measure_concurrently(
                        target.chat,
                        probes,
                        max(0.5, duration - 2 * _EDGE_SECONDS),
                        cpus,
                        expect=CHAT_REPLY,
                    )
                finally:
                    wrk = finish_wrk(process)
            rate = wrk.requests_per_s + probe.count / max(probe.elapsed_s, 1e-9)
            source = f"{probes} probe connections beside {concurrency - probes} of wrk"
        _check_alive(target)
        return {
            "connections": concurrency,
            "requests_per_s": round(rate, 1),
            "wrk_requests": wrk.requests,
            "errors": wrk.errors + probe.errors,
            "latency_ms": summarize_ns(probe.latencies_ns),
            "latency_source": source,
            # Little's law cross-check: with closed-loop clients the mean
            # latency is connections / throughput.
            "implied_mean_ms": round(concurrency / rate * 1000, 3) if rate else None,
            "cpu_percent": cpu,
            "cpu_ms_per_request": _cpu_cost(cpu, rate),
        }

    def _measure_stream(
        self, target: _Target, script: Path, concurrency: int
    ) -> dict[str, Any]:
        duration = self.options.duration
        cpus = target.load_cpus
        with _cpu_usage(target.watched, duration) as cpu:
            wrk = finish_wrk(
                start_wrk(
                    self.wrk,
                    target.stream,
                    script,
                    concurrency,
                    duration,
                    pin_prefix(cpus),
                )
            )
        streams = measure_concurrently(
            target.stream, concurrency, duration, cpus, expect=STREAM_END
        )
        _check_alive(target)
        return {
            "connections": concurrency,
            "streams_per_s": round(wrk.requests_per_s, 1),
            "client_streams_per_s": round(
                streams.count / max(streams.elapsed_s, 1e-9), 1
            ),
            "errors": wrk.errors + streams.errors,
            "ttfb_ms": summarize_ns(streams.first_bytes_ns),
            "stream_ms": summarize_ns(streams.latencies_ns),
            "cpu_percent": cpu,
            "cpu_ms_per_request": _cpu_cost(cpu, wrk.requests_per_s),
        }

    def profile(self, target: _Target, server: Child) -> dict[str, Any]:
        """Sample the serving process with py-spy under the c=16 chat load."""
        assert self.options.profile_dir is not None
        # Installed into the virtualenv, whose bin/ need not be on PATH.
        py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
        py_spy = py_spy or shutil.which("py-spy")
        if py_spy is None:
            return {"error": "py-spy is not installed (pip install py-spy)"}
        self.options.profile_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        output = self.options.profile_dir / f"profile-{target.label}-{stamp}.txt"
        duration = self.options.duration
        self.progress(f"  {target.label}: profiling under 16 connections")
        script = self.scratch / f"{target.label}-chat.lua"
        wrk = start_wrk(
            self.wrk, target.chat, script, 16, duration, pin_prefix(target.load_cpus)
        )
        record = subprocess.run(
            [
                *pin_prefix(target.load_cpus),
                py_spy,
                "record",
                "--pid",
                str(server.pid),
                "--duration",
                str(max(1, duration - 1)),
                "--rate",
                "250",
                "--nonblocking",
                "--format",
                "raw",
                "--output",
                str(output),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        finish_wrk(wrk)
        if record.returncode != 0:
            return {"error": (record.stderr or record.stdout).strip()[-500:]}
        return {"flamegraph": str(output)}


def _endpoints(base_url: str, headers: dict[str, str]) -> tuple[Endpoint, Endpoint]:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    extra = tuple(headers.items())
    chat = json.dumps(CHAT_BODY, separators=(",", ":")).encode()
    stream = json.dumps({**CHAT_BODY, "stream": True}, separators=(",", ":")).encode()
    path = "/v1/chat/completions"
    return (
        Endpoint(host, int(port), path, chat, extra),
        Endpoint(host, int(port), path, stream, extra),
    )


def _check_replies(target: _Target) -> None:
    """Fail early, with the reply, unless both requests are answered properly."""
    for endpoint, marker in ((target.chat, CHAT_REPLY), (target.stream, STREAM_END)):
        response = fetch_once(endpoint)
        if response.status != 200 or marker not in response.body:
            raise BenchError(
                f"{target.label}: {endpoint.url} answered HTTP {response.status}: "
                f"{response.body[:500].decode(errors='replace')}"
            )
        if "server" in target.watched:
            served_by = response.headers.get(b"x-nexus-backend", b"").decode()
            if served_by != BACKEND_NAME:
                raise BenchError(
                    f"{target.label}: served by {served_by!r}, not {BACKEND_NAME!r}"
                )


def _check_alive(target: _Target) -> None:
    for child in target.watched.values():
        child.check_alive()


@contextlib.contextmanager
def _cpu_usage(
    watched: dict[str, Child], duration: float
) -> Iterator[dict[str, float]]:
    """Fill a dict with each watched process's CPU use (percent of one CPU)."""
    usage: dict[str, float] = {}
    before = {name: child.cpu_seconds() for name, child in watched.items()}
    began = time.monotonic()
    yield usage
    wall = max(time.monotonic() - began, 1e-9)
    for name, child in watched.items():
        usage[name] = round((child.cpu_seconds() - before[name]) / wall * 100, 1)


def _cpu_cost(cpu: dict[str, float], rate: float) -> dict[str, float | None]:
    """Return each process's CPU time per request, in ms.

    Unlike rates and latencies, this hardly changes when other processes compete
    for the CPUs, so it still compares runs on a busy machine.
    """
    return {
        name: round(percent / 100 / rate * 1000, 3) if rate else None
        for name, percent in cpu.items()
    }


def _python_version() -> str:
    import platform

    return platform.python_version()


def _wrk_version(wrk: str) -> str:
    result = subprocess.run(
        [wrk, "--version"], capture_output=True, text=True, check=False
    )
    return (result.stdout or result.stderr).split(" [")[0].strip()
