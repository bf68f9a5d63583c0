"""What the benchmark measures on each target, and how long that takes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.bench.processes import TargetSpec

# Seconds to start a target and see it settle, for the run-time estimate.
_START_SECONDS = {"nexus": 4.0, "reference": 2.0, "peer": 20.0, "direct": 0.0}
_SET_UP_SECONDS = 6.0  # migrations, the mock, the bench rows

DEFAULT_DURATION = 6
DEFAULT_WARMUP = 3.0


@dataclass(frozen=True, slots=True)
class Plan:
    """What is measured on one target."""

    chat: tuple[int, ...]  # chat concurrencies
    # Latency probes beside wrk (else wrk alone holds every connection: on
    # multi-process targets, which share the CPUs with the clients, a Python
    # probe would take CPU from the servers).
    probe: bool = True
    paced_stream: bool = True  # TTFB at a paced rate of new streams
    streams: tuple[int, ...] = ()  # closed-loop streams/s (wrk) concurrencies

    def measurements(self) -> int:
        """How many measurements of ``duration`` seconds the plan takes."""
        chat = sum(2 if c == 1 and self.probe else 1 for c in self.chat)
        return chat + int(self.paced_stream) + len(self.streams)


FULL_PLAN = Plan(chat=(1, 16, 64), streams=(8,))
REFERENCE_PLAN = Plan(chat=(16,), paced_stream=False)
MULTI_PROCESS_PLAN = Plan(chat=(16, 64), probe=False, paced_stream=False)
PEER_PLAN = Plan(chat=(1, 16))


def plan_for(spec: TargetSpec | None) -> Plan:
    """The direct run (None) and one process of Nexus get everything."""
    if spec is None or (spec.role == "nexus" and not spec.is_multi_process):
        return FULL_PLAN
    if spec.role == "reference":
        return REFERENCE_PLAN
    if spec.role == "peer":
        return PEER_PLAN
    return MULTI_PROCESS_PLAN


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What to measure and for how long."""

    duration: int = DEFAULT_DURATION  # seconds per measurement
    warmup: float = DEFAULT_WARMUP  # seconds of load before a target is measured
    targets: tuple[TargetSpec, ...] = ()
    pin: bool = True
    stream_rate: float = 40.0  # new streams per second in the paced run
    stream_chunks: int = 16
    profile_dir: Path | None = None  # where py-spy profiles go; None: no profiling
    wrk: str = "wrk"
    litellm: str | None = None  # LiteLLM's executable (make bench-peers)
    # The translated and pass-through Anthropic paths on the first Nexus target.
    surfaces: bool = True
    # And the Responses and Ollama surfaces (make bench BENCH_ARGS=--all-surfaces).
    all_surfaces: bool = False


def estimate_seconds(options: BenchOptions) -> float:
    """About how long ``run_benchmark`` takes with these options."""
    total = _SET_UP_SECONDS
    for spec in (None, *options.targets):
        plan = plan_for(spec)
        total += plan.measurements() * options.duration
        total += _START_SECONDS["direct" if spec is None else spec.role]
        if options.warmup:
            total += max(1.0, options.warmup) + (1.0 if plan.paced_stream else 0.0)
        if options.profile_dir is not None and spec is not None:
            total += options.duration if spec.role == "nexus" else 0
    nexus = [s for s in options.targets if s.role == "nexus" and not s.is_multi_process]
    if options.surfaces and nexus:
        # Two paths (four with all_surfaces) of two measurements each, with
        # their warm-ups.
        paths = 4 if options.all_surfaces else 2
        total += paths * (2 * options.duration + max(1.0, options.warmup) + 1.0)
    return total
