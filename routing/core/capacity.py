"""Learned capacity: what a node says about its memory, and when it may load.

The fleet strategy's memory signals read a node's memory limit
(``memory_limit``): the operator's ``memory_ceiling_gb`` when set (an
override), else the memory the node reported (``BackendSpec.memory_total_gb``,
from a health probe or a relay worker's report), else what its last
out-of-memory error told (memory in use + "available").

A node is paused for new cold loads (``cold_load_pause``): requests for
models it has loaded still go there, a model it would have to load goes
elsewhere (reason ``cold_loads_paused``), and nothing is warmed up there.
The rule:

- while the node's last report says it is under memory pressure
  (``BackendSpec.memory_pressure``); the first report without it ends it;
- after OOM_PAUSE_FAILURES out-of-memory load failures within
  OOM_PAUSE_SECONDS of each other (``LiveStats.note_oom``, fed by the
  proxy and warm-ups of this serving process), until OOM_PAUSE_SECONDS after
  the last one, or sooner when a report taken after it shows at least
  MEMORY_FREED_GB less in use than the node had reported before it (a model
  was unloaded there).

Pure functions over the snapshot and the live stats: no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from routing.core.stats import LiveStats, LoadFailures
from routing.core.types import BackendSpec

OOM_PAUSE_FAILURES = 2
OOM_PAUSE_SECONDS = 120.0
MEMORY_FREED_GB = 0.5
# Bytes of an error answer looked at for out-of-memory words.
OOM_SCAN_BYTES = 4096
MAX_DETAIL = 200
_GB_PER_UNIT = {"gib": 1.073741824, "gb": 1.0, "mib": 0.001048576, "mb": 0.001}

# The servers' own words (real examples recorded in
# tests/fixtures/out_of_memory/errors.json):
# Ollama's refusal before a load ("model requires more system memory (5.3
# GiB) than is available (3.3 GiB)"), its runner dying in a load ("llama
# runner process has terminated: CUDA error: out of memory", "... error
# loading model: unable to allocate CUDA0 buffer"), llama.cpp's allocator
# ("cudaMalloc failed: out of memory", "failed to allocate ... buffer").
_OOM_WORDS = re.compile(
    r"requires more system memory|out of memory|unable to allocate"
    r"|failed to allocate|insufficient memory|not enough memory",
    re.IGNORECASE,
)
_OLLAMA_SIZES = re.compile(
    r"requires more system memory \((\d+(?:\.\d+)?) ?(GiB|GB|MiB|MB)\) than is "
    r"available \((\d+(?:\.\d+)?) ?(GiB|GB|MiB|MB)\)",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class OutOfMemory:
    """A server's out-of-memory error: its words, and the sizes it named (GB)."""

    detail: str
    required_gb: float | None = None
    available_gb: float | None = None


def parse_out_of_memory(body: bytes) -> OutOfMemory | None:
    """The out-of-memory error in an error answer's body, if it is one.

    Reads Ollama's ``{"error": "..."}``, the OpenAI shape ``{"error":
    {"message": "..."}}`` (llama.cpp) or plain text; only the first
    OOM_SCAN_BYTES bytes.
    """
    text = body[:OOM_SCAN_BYTES].decode("utf-8", "replace")
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            error = error.get("message")
        if isinstance(error, str):
            text = error
    if not _OOM_WORDS.search(text):
        return None
    detail = " ".join(text.split())[:MAX_DETAIL]
    sizes = _OLLAMA_SIZES.search(text)
    if sizes is None:
        return OutOfMemory(detail)
    return OutOfMemory(
        detail,
        required_gb=_gigabytes(sizes.group(1), sizes.group(2)),
        available_gb=_gigabytes(sizes.group(3), sizes.group(4)),
    )


def _gigabytes(number: str, unit: str) -> float:
    return round(float(number) * _GB_PER_UNIT[unit.lower()], 3)


def note_out_of_memory(
    stats: LiveStats, backend: BackendSpec, model: str, error: OutOfMemory
) -> tuple[float | None, float | None]:
    """Record that `backend` could not load `model` (see the module docstring);
    return the GB the node had in use and its memory, as far as known.

    The model is not loaded there (whatever sending the request for it made
    this process expect). The memory the node has is learned from the error
    when it says what is available: what the node reported in use (or the
    models it lists as loaded) plus that.
    """
    used = backend.memory_reported_used_gb
    if used is None:
        used = backend.memory_used_gb
    total = None
    if error.available_gb is not None and used is not None:
        total = round(used + error.available_gb, 3)
    stats.note_oom(backend.name, model, error.detail, used_gb=used, total_gb=total)
    stats.mark_evicted(backend.name, model)
    return used, total


def memory_limit(backend: BackendSpec, stats: LiveStats) -> float | None:
    """GB models may fill on `backend`: the override, the report, or the last
    out-of-memory error's; None when nothing says."""
    limit = backend.memory_limit_gb
    if limit is not None:
        return limit
    record = stats.oom_failures(backend.name)
    return None if record is None else record.total_gb


def memory_source(backend: BackendSpec, stats: LiveStats) -> str:
    """Where ``memory_limit`` came from: "ceiling", "reported", "oom" or ""."""
    if backend.memory_ceiling_gb is not None:
        return "ceiling"
    if backend.memory_total_gb is not None:
        return "reported"
    record = stats.oom_failures(backend.name)
    return "oom" if record is not None and record.total_gb is not None else ""


def cold_load_pause(backend: BackendSpec, stats: LiveStats, now: float) -> str:
    """Why `backend` takes no new cold loads at wall time `now` ("": it does)."""
    if backend.memory_pressure:
        return "the node reports memory pressure"
    record = stats.oom_failures(backend.name)
    if record is None or len(record.times) < OOM_PAUSE_FAILURES:
        return ""
    times = record.times
    last = times[-1]
    if now - last >= OOM_PAUSE_SECONDS:
        return ""
    if last - times[-OOM_PAUSE_FAILURES] > OOM_PAUSE_SECONDS:
        return ""
    if _freed_since(backend, record, last):
        return ""
    return (
        f"{OOM_PAUSE_FAILURES} out-of-memory load failures within "
        f"{OOM_PAUSE_SECONDS:g} s, the last {max(now - last, 0):.0f} s ago "
        f"({record.model}: {record.detail})"
    )


def _freed_since(backend: BackendSpec, record: LoadFailures, at: float) -> bool:
    """A report newer than `at` shows memory freed since the failure."""
    reported_at = backend.memory_reported_at
    used = backend.memory_reported_used_gb
    return (
        reported_at is not None
        and reported_at > at
        and used is not None
        and record.used_gb is not None
        and used <= record.used_gb - MEMORY_FREED_GB
    )
