"""Run the benchmark: the same load straight at the mock, then at each target.

One mock backend serves every run. It is measured directly first (the limit),
then each target (the bare Daphne reference, Nexus under each server in one or
several processes, LiteLLM if given) is started alone, warmed up, and measured
with the same clients. Nothing runs in parallel except the load generators of
one measurement.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings

from tests.bench.clients import (
    BenchError,
    Endpoint,
    Samples,
    fetch_once,
    finish_wrk,
    measure_concurrently,
    measure_paced,
    start_wrk,
    write_wrk_script,
)
from tests.bench.cpu import cpu_cost, measure_cpu
from tests.bench.database import (
    BACKEND_NAME,
    MODEL,
    describe_settings,
    install_bench_rows,
)
from tests.bench.peers import (
    MASTER_KEY,
    READY_PATH,
    litellm_command,
    litellm_environment,
    write_litellm_config,
)
from tests.bench.plan import BenchOptions, Plan, estimate_seconds, plan_for
from tests.bench.processes import (
    Pinning,
    ProcessGroup,
    TargetSpec,
    pin_prefix,
    plan_pinning,
    start_mock,
    start_target,
    version_of,
)
from tests.bench.profiles import record_profile
from tests.bench.report import build_report, summarize_ns
from tests.bench.surfaces import (
    ANTHROPIC_BACKEND,
    ANTHROPIC_MODEL,
    PATHS,
    SURFACE_PATHS,
    compare_surfaces,
    install_anthropic_rows,
)
from tests.bench.surfaces import PLAN as SURFACE_PLAN

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


@dataclass
class _Target:
    """One thing to measure: the mock itself, or a server in front of it."""

    label: str
    plan: Plan
    chat: Endpoint
    stream: Endpoint
    load_cpus: frozenset[int]
    spec: TargetSpec | None = None
    watched: dict[str, ProcessGroup] = field(default_factory=dict)
    requests: int = 0  # answered so far, warm-up included
    # What a good answer holds, and which backend must have served it.
    chat_marker: bytes = CHAT_REPLY
    stream_marker: bytes = STREAM_END
    backend: str = BACKEND_NAME


def run_benchmark(
    options: BenchOptions, env: dict[str, str], progress: Progress
) -> dict[str, Any]:
    """Measure the mock directly and through each target; return the report.

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
        if options.surfaces:
            claude = start_mock(
                env,
                cwd,
                scratch,
                pinning.mock,
                name=ANTHROPIC_BACKEND,
                model=ANTHROPIC_MODEL,
                chunks=options.stream_chunks,
                kind="anthropic",
            )
            stack.callback(claude.stop)
            stack.enter_context(install_anthropic_rows(claude.url))
            runner.surfaces_mock = claude
        direct = _Target(
            "direct",
            plan_for(None),
            *_endpoints(mock.url, {}),
            load_cpus=pinning.load_direct,
            watched={"mock": mock},
        )
        progress(f"Mock backend at {mock.url}; measuring it directly")
        results["direct"] = runner.measure(direct)
        for spec in options.targets:
            results[spec.label] = runner.run_target(spec, mock, env, cwd, key)
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
            "granian": version_of("granian"),
            "litellm": _litellm_version(options.litellm),
            "wrk": _wrk_version(wrk),
            "settings": describe_settings(),
            "pinning": pinning.describe(),
            "estimated_s": round(estimate_seconds(options)),
            "elapsed_s": round(time.time() - started_at),
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
        # The Anthropic-kind mock, until the surface paths have been measured.
        self.surfaces_mock: ProcessGroup | None = None

    def run_target(
        self,
        spec: TargetSpec,
        mock: ProcessGroup,
        env: dict[str, str],
        cwd: Path,
        key: str,
    ) -> dict[str, Any]:
        """Start one target, measure it (and profile it if asked), stop it."""
        pinned = not spec.is_multi_process
        server_cpus = self.pinning.server if pinned else frozenset()
        load_cpus = self.pinning.load_via_server if pinned else frozenset()
        auth = {"Authorization": f"Bearer {key}"}
        ready: tuple[str, dict[str, str]] = ("/v1/models", auth)
        litellm: list[str] = []
        if spec.role == "reference":
            ready = ("/", {})
        elif spec.role == "peer":
            assert self.options.litellm is not None
            config = write_litellm_config(self.scratch, mock.url, MODEL)
            litellm = litellm_command(self.options.litellm, config)
            env = litellm_environment(env)
            auth = {"Authorization": f"Bearer {MASTER_KEY}"}
            ready = (READY_PATH, {})
        self.progress(
            f"Starting {spec.label} ({spec.workers} serving process"
            f"{'es' * spec.is_multi_process}, "
            f"{'pinned' if pinned and server_cpus else 'not pinned'})"
        )
        try:
            server = start_target(
                spec, env, cwd, self.scratch, server_cpus, ready, litellm
            )
        except BenchError as error:
            if spec.role != "peer":
                raise
            raise BenchError(
                f"LiteLLM's proxy ({self.options.litellm}) could not be started "
                f"here: {error}"
            ) from None
        if not pinned:
            # Every CPU for the servers: the mock may use any of them too.
            mock.set_affinity(os.sched_getaffinity(0))
        try:
            target = _Target(
                spec.label,
                plan_for(spec),
                *_endpoints(server.url, auth),
                load_cpus=load_cpus,
                spec=spec,
                watched={"server": server, "mock": mock},
            )
            result = self.measure(target)
            claude = self.surfaces_mock
            if claude is not None and spec.role == "nexus" and pinned:
                self.surfaces_mock = None  # the first single-process target only
                result["surfaces"] = self.measure_surfaces(
                    target, server.url, key, claude
                )
                result["surface_comparison"] = compare_surfaces(
                    result, self.options.stream_chunks
                )
            result["target"] = {
                "server": spec.server,
                "role": spec.role,
                "processes": spec.workers,
                "pinned": bool(pinned and server_cpus),
                "command": " ".join(_short_argv(server.roots[0].args)),
            }
            if self.options.profile_dir is not None and spec.role == "nexus":
                result["profile"] = self.profile(target, server)
            return result
        finally:
            server.stop()
            if not pinned and self.pinning.mock:
                mock.set_affinity(self.pinning.mock)

    def measure_surfaces(
        self, plain: _Target, url: str, key: str, claude: ProcessGroup
    ) -> dict[str, Any]:
        """Measure every surface path (``SURFACE_PATHS``) like the plain one."""
        results = {}
        names = PATHS if self.options.all_surfaces else PATHS[:2]
        for path in (p for p in SURFACE_PATHS if p.name in names):
            model, backend = (
                (ANTHROPIC_MODEL, ANTHROPIC_BACKEND)
                if path.anthropic_backend
                else (MODEL, BACKEND_NAME)
            )
            target = _Target(
                f"{plain.label}-{path.name}",
                SURFACE_PLAN,
                *path.endpoints(url, key, CHAT_BODY, model),
                load_cpus=plain.load_cpus,
                spec=plain.spec,
                watched={**plain.watched, "claude": claude},
                chat_marker=path.chat_marker,
                stream_marker=path.stream_marker,
                backend=backend,
            )
            results[path.name] = self.measure(target)
        return results

    def measure(self, target: _Target) -> dict[str, Any]:
        """Check, warm up, then measure what the target's plan says."""
        plan = target.plan
        _check_replies(target)
        chat_script = write_wrk_script(
            self.scratch, target.chat, f"{target.label}-chat"
        )
        stream_script = write_wrk_script(
            self.scratch, target.stream, f"{target.label}-stream"
        )
        self._warm_up(target, chat_script)
        result: dict[str, Any] = {"chat": {}, "stream": {}, "paced_stream": None}
        server = target.watched.get("server")
        if server is not None:
            result["rss_after_warmup_kib"] = _rss_total(server)
        for concurrency in plan.chat:
            self.progress(f"  {target.label}: chat, {concurrency} connections")
            result["chat"][str(concurrency)] = self._measure_chat(
                target, chat_script, concurrency
            )
        if plan.paced_stream:
            rate = self.options.stream_rate
            self.progress(f"  {target.label}: streaming, {rate:g} new streams/s")
            result["paced_stream"] = self._measure_paced_stream(target, rate)
        for concurrency in plan.streams:
            self.progress(f"  {target.label}: streaming, {concurrency} connections")
            result["stream"][str(concurrency)] = self._measure_stream(
                target, stream_script, concurrency
            )
        if server is not None:
            server.check_alive()
            memory = server.memory_kib()
            result["rss_end_kib"] = sum(m["VmRSS"] for m in memory.values())
            result["peak_rss_kib"] = max(m["VmHWM"] for m in memory.values())
            result["processes"] = [
                {"pid": pid, "rss_kib": m["VmRSS"], "peak_rss_kib": m["VmHWM"]}
                for pid, m in memory.items()
            ]
            result["pid"] = server.pid
        result["requests"] = target.requests
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
        target.requests += finish_wrk(wrk).requests
        if target.plan.paced_stream or target.plan.streams:
            streams = measure_concurrently(
                target.stream,
                4,
                min(1.0, self.options.warmup),
                expect=target.stream_marker,
            )
            target.requests += streams.count

    def _measure_chat(
        self, target: _Target, script: Path, concurrency: int
    ) -> dict[str, Any]:
        duration = self.options.duration
        cpus = target.load_cpus
        probe = Samples()
        if not target.plan.probe:
            with measure_cpu(target.watched) as cpu:
                wrk = finish_wrk(
                    start_wrk(
                        self.wrk,
                        target.chat,
                        script,
                        concurrency,
                        duration,
                        pin_prefix(cpus),
                    )
                )
            rate = wrk.requests_per_s
            source = f"none: wrk alone holds the {concurrency} connections"
        elif concurrency == 1:
            # Throughput and latency from separate runs: a second connection
            # would double the concurrency being measured.
            with measure_cpu(target.watched) as cpu:
                wrk = finish_wrk(
                    start_wrk(
                        self.wrk, target.chat, script, 1, duration, pin_prefix(cpus)
                    )
                )
            probe = measure_concurrently(
                target.chat, 1, duration, cpus, expect=target.chat_marker
            )
            rate = wrk.requests_per_s
            source = "1 probe connection alone (after wrk's run)"
        else:
            # A quarter of the connections are the probe's, the rest wrk's: the
            # probe sees the same queue as every other client, and enough of
            # its replies to give a p99.
            probes = max(1, concurrency // PROBE_SHARE)
            with measure_cpu(target.watched) as cpu:
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
                        expect=target.chat_marker,
                    )
                finally:
                    wrk = finish_wrk(process)
            rate = wrk.requests_per_s + probe.count / max(probe.elapsed_s, 1e-9)
            source = f"{probes} probe connections beside {concurrency - probes} of wrk"
        target.requests += wrk.requests + probe.count
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
            "cpu_percent": cpu.percent,
            "server_cpu_percent_by_process": cpu.server_by_process,
            "machine_busy_percent": cpu.machine_busy,
            "cpu_ms_per_request": cpu_cost(cpu.percent, rate),
        }

    def _measure_paced_stream(self, target: _Target, rate: float) -> dict[str, Any]:
        with measure_cpu(target.watched) as cpu:
            streams = measure_paced(
                target.stream,
                rate,
                self.options.duration,
                target.load_cpus,
                expect=target.stream_marker,
            )
        target.requests += streams.count
        _check_alive(target)
        achieved = streams.count / max(streams.elapsed_s, 1e-9)
        return {
            "offered_per_s": rate,
            "streams_per_s": round(achieved, 1),
            "errors": streams.errors,
            "max_lag_ms": round(streams.max_lag_ns / 1e6, 3),
            "ttfb_ms": summarize_ns(streams.first_bytes_ns),
            "stream_ms": summarize_ns(streams.latencies_ns),
            "cpu_percent": cpu.percent,
            "cpu_ms_per_request": cpu_cost(cpu.percent, achieved),
        }

    def _measure_stream(
        self, target: _Target, script: Path, concurrency: int
    ) -> dict[str, Any]:
        duration = self.options.duration
        with measure_cpu(target.watched) as cpu:
            wrk = finish_wrk(
                start_wrk(
                    self.wrk,
                    target.stream,
                    script,
                    concurrency,
                    duration,
                    pin_prefix(target.load_cpus),
                )
            )
        target.requests += wrk.requests
        _check_alive(target)
        return {
            "connections": concurrency,
            "streams_per_s": round(wrk.requests_per_s, 1),
            "errors": wrk.errors,
            "cpu_percent": cpu.percent,
            "cpu_ms_per_request": cpu_cost(cpu.percent, wrk.requests_per_s),
        }

    def profile(self, target: _Target, server: ProcessGroup) -> dict[str, Any]:
        """Profile every process of the target under the c=16 chat load."""
        assert self.options.profile_dir is not None
        self.options.profile_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        output = self.options.profile_dir / f"profile-{target.label}-{stamp}.txt"
        duration = self.options.duration
        self.progress(f"  {target.label}: profiling under 16 connections")
        script = self.scratch / f"{target.label}-chat.lua"
        wrk = start_wrk(
            self.wrk, target.chat, script, 16, duration, pin_prefix(target.load_cpus)
        )
        try:
            return record_profile(
                [root.pid for root in server.roots],
                max(1, duration - 1),
                output,
                pin_prefix(target.load_cpus),
            )
        finally:
            target.requests += finish_wrk(wrk).requests


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
    """Fail early, with the reply, unless the requests measured are answered."""
    checks = [(target.chat, target.chat_marker)]
    if target.plan.paced_stream or target.plan.streams:
        checks.append((target.stream, target.stream_marker))
    for endpoint, marker in checks:
        response = fetch_once(endpoint)
        if response.status != 200 or marker not in response.body:
            raise BenchError(
                f"{target.label}: {endpoint.url} answered HTTP {response.status}: "
                f"{response.body[:500].decode(errors='replace')}"
            )
        if target.spec is not None and target.spec.role == "nexus":
            served_by = response.headers.get(b"x-nexus-backend", b"").decode()
            if served_by != target.backend:
                raise BenchError(
                    f"{target.label}: served by {served_by!r}, not {target.backend!r}"
                )


def _check_alive(target: _Target) -> None:
    for group in target.watched.values():
        group.check_alive()


def _rss_total(group: ProcessGroup) -> int:
    return sum(m["VmRSS"] for m in group.memory_kib().values())


def _short_argv(argv: Any) -> list[str]:
    """The command line as run, with the interpreter's path shortened."""
    words = [str(word) for word in argv]
    return [Path(word).name if word.startswith("/") else word for word in words]


def _python_version() -> str:
    import platform

    return platform.python_version()


def _litellm_version(executable: str | None) -> str | None:
    if executable is None:
        return None
    python = Path(executable).with_name("python")
    result = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m; print(m.version('litellm'))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout.strip() or "unknown"


def _wrk_version(wrk: str) -> str:
    result = subprocess.run(
        [wrk, "--version"], capture_output=True, text=True, check=False
    )
    return (result.stdout or result.stderr).split(" [")[0].strip()
