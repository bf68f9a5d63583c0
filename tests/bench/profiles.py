"""Summaries of py-spy profiles: where a serving process spent its samples.

``--profile`` records py-spy's ``raw`` (collapsed stack) format: one line per
distinct stack, ``frame;frame;...;leaf count``, root first, with frames named
``function (file:first line)`` (recorded with ``--function``, so one function is
one frame wherever its samples fell). With ``--subprocesses`` each stack starts
with ``process PID:"command"`` frames, which the summary drops so that the
processes of a target add up.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOP_SELF = 20
TOP_INCLUSIVE = 30
SAMPLES_PER_S = 250


def record_profile(
    pids: Sequence[int], seconds: int, output: Path, prefix: Sequence[str] = ()
) -> dict[str, Any]:
    """Record py-spy on ``pids`` (and their children) and summarise it.

    One py-spy per process, all at once; their collapsed stacks go into
    ``output``. Only threads holding the GIL are sampled (``--gil``): the
    profile is where Python's CPU time goes, not threads waiting on a queue or
    inside a server's native code. py-spy pauses a process for each sample (its
    default), which costs the process a little time but keeps every stack whole. ``prefix``
    goes before py-spy (e.g. ``taskset`` words). Returns the summary, or
    ``{"error": ...}`` when py-spy is missing or fails.
    """
    # Installed into the virtualenv, whose bin/ need not be on PATH.
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    py_spy = py_spy or shutil.which("py-spy")
    if py_spy is None:
        return {"error": "py-spy is not installed (pip install py-spy)"}
    parts = [output.with_name(f"{output.stem}-{pid}.txt") for pid in pids]
    recorders = [
        subprocess.Popen(
            [
                *prefix,
                py_spy,
                "record",
                "--pid",
                str(pid),
                "--subprocesses",
                "--function",
                "--gil",
                "--duration",
                str(seconds),
                "--rate",
                str(SAMPLES_PER_S),
                "--format",
                "raw",
                "--output",
                str(part),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid, part in zip(pids, parts, strict=True)
    ]
    failures = []
    for recorder in recorders:
        out, _ = recorder.communicate()
        if recorder.returncode != 0:
            failures.append(out.strip()[-500:])
    if failures:
        return {"error": "\n".join(failures)}
    output.write_text("".join(part.read_text() for part in parts))
    for part in parts:
        part.unlink()
    return summarize_profile(output)


def summarize_profile(
    path: Path, top_self: int = TOP_SELF, top_inclusive: int = TOP_INCLUSIVE
) -> dict[str, Any]:
    """The frames with the most self and inclusive samples, in percent of all.

    Self: samples with the frame at the top of the stack (running its own
    code). Inclusive: samples with the frame anywhere on the stack (counted
    once per sample however deep the recursion). The entry chain of the stacks
    (runpy, a server's command line, the loop's ``run_forever``: frames that
    only ever call the same one frame, from the root down) is listed apart as
    ``trunk``, not ranked, as it has the inclusive time of the frame it calls:
    the inclusive ranking starts where the work divides.
    """
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    callees: dict[str, set[str | None]] = defaultdict(set)
    stacks: list[list[str]] = []
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        if not frames:
            continue
        count = int(count_text)
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            anywhere[frame] += count
        for caller, callee in zip(frames, [*frames[1:], None], strict=True):
            callees[caller].add(callee)
        stacks.append(frames)
    # Frames that call one frame only, and below them only such frames.
    passing = {f for f, called in callees.items() if len(called) == 1} - {None}
    passing -= {f for f, called in callees.items() if None in called}
    trunk = set(passing)
    for frames in stacks:
        depth = 0
        while depth < len(frames) and frames[depth] in passing:
            depth += 1
        trunk -= set(frames[depth:])
    depth_of: dict[str, int] = {}
    for frames in stacks:
        for depth, frame in enumerate(frames):
            if frame in trunk:
                depth_of.setdefault(frame, depth)
    for frame in trunk:
        del anywhere[frame]
    return {
        "file": str(path),
        "samples": total,
        "top_self": _ranked(own, total, top_self),
        "top_inclusive": _ranked(anywhere, total, top_inclusive),
        "trunk": sorted(trunk, key=lambda frame: depth_of[frame]),
    }


def _ranked(counts: Counter[str], total: int, limit: int) -> list[dict[str, Any]]:
    return [
        {"frame": frame, "percent": round(100 * count / total, 1), "samples": count}
        for frame, count in counts.most_common(limit)
    ]
