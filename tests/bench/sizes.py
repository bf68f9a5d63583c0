"""File sizes of the product at a commit: ``python -m tests.bench.sizes [COMMIT]``.

Counts the lines of every product ``.py`` file (not tests, not migrations) in
the commit's tree and prints the count, median, 90th percentile, largest, and
how many are over 400 and 800 lines (the style guide's threshold), then the
largest files. Used to compare layouts (issue 26).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.sizes")
    parser.add_argument("commit", nargs="?", default="HEAD")
    parser.add_argument("--top", type=int, default=8)
    options = parser.parse_args(argv)
    names = _git("ls-tree", "-r", "--name-only", options.commit).split()
    sizes = sorted(
        (_git("show", f"{options.commit}:{name}").count("\n"), name)
        for name in names
        if name.endswith(".py")
        and not name.startswith("tests/")
        and "/migrations/" not in name
    )
    sizes = [(lines, name) for lines, name in sizes if lines]
    lines = [n for n, _ in sizes]
    p90 = statistics.quantiles(lines, n=10)[8]
    report = [
        (
            f"{options.commit}: {len(lines)} files, {sum(lines)} lines; median "
            f"{statistics.median(lines):.0f}, p90 {p90:.0f}, max {lines[-1]} "
            f"({sizes[-1][1]}); over 400: {sum(n > 400 for n in lines)}, over 800: "
            f"{sum(n > 800 for n in lines)}"
        ),
        *(f"  {n:5} {name}" for n, name in sizes[-options.top :]),
    ]
    sys.stdout.write("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
