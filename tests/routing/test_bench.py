"""`make bench` (tests.bench) in smoke mode: real mock, servers and wrk.

These tests check that the benchmark runs end to end and reports every figure
it promises, never how fast anything is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from backends.models import Backend
from tests.bench.cli import main
from tests.bench.database import BACKEND_NAME, KEY_NAME
from tests.bench.plan import BenchOptions, estimate_seconds
from tests.bench.processes import DEFAULT_TARGETS, ProcessGroup, parse_targets
from tests.bench.profiles import summarize_profile
from tests.bench.surfaces import ANTHROPIC_BACKEND
from tests.conftest import REPO_ROOT
from usage.models import ApiKey

needs_wrk = pytest.mark.skipif(
    shutil.which("wrk") is None, reason="needs wrk (Debian: apt-get install wrk)"
)


def _assert_percentiles(summary: dict[str, float | int | None]) -> None:
    assert summary["samples"] > 0
    assert 0 < summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]


@needs_wrk
@pytest.mark.skipif(
    not settings.NEXUS_PRODUCTION,
    reason="`make bench` serves in production mode: its smoke run is tested there",
)
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_smoke_run_reports_every_figure_for_each_kind_of_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = "bare-daphne,daphne,granian-xN"
    argv = ["--duration", "1", "--quick", "--servers", servers, "--workers", "2"]
    argv.append("--all-surfaces")
    assert main([*argv, "--output", str(tmp_path)]) == 0

    report = json.loads((tmp_path / "latest.json").read_text())
    assert list(tmp_path.glob("bench-*.json")), "a timestamped copy is kept too"
    # The report says which settings the serving processes ran with.
    mode = "production" if settings.NEXUS_PRODUCTION else "embedded"
    assert report["environment"]["settings"].startswith(f"{mode} ({connection.vendor}")
    assert report["environment"]["estimated_s"] > 0
    assert set(report["servers"]) == {"bare-daphne", "daphne", "granian-x2"}
    direct, servers = report["direct"], report["servers"]
    # The mock directly and one Nexus process: every figure.
    for data in (direct, servers["daphne"]):
        assert set(data["chat"]) == {"1", "16", "64"}
        for concurrency, cell in data["chat"].items():
            _assert_chat_cell(cell, int(concurrency))
            _assert_percentiles(cell["latency_ms"])
        paced = data["paced_stream"]
        assert paced["offered_per_s"] == 40
        assert paced["streams_per_s"] > 0
        assert paced["errors"] == 0
        _assert_percentiles(paced["ttfb_ms"])
        _assert_percentiles(paced["stream_ms"])
        assert paced["ttfb_ms"]["p50"] <= paced["stream_ms"]["p50"]
        assert set(data["stream"]) == {"8"}
        assert data["stream"]["8"]["streams_per_s"] > 0
        assert data["stream"]["8"]["errors"] == 0
    daphne = servers["daphne"]
    assert daphne["target"]["processes"] == len(daphne["processes"]) == 1
    assert daphne["peak_rss_kib"] >= daphne["rss_end_kib"] > 0
    compared = report["comparison"]["daphne"]
    assert compared["chat"]["16"]["throughput_ratio"] > 0
    assert compared["paced_stream"]["ttfb_added_p50_ms"] is not None
    # The protocol surfaces, on the first single-process Nexus target only.
    assert set(daphne["surfaces"]) == {
        "translated",
        "pass-through",
        "responses",
        "ollama",
    }
    for path, cell in daphne["surface_comparison"].items():
        measured = daphne["surfaces"][path]
        _assert_chat_cell(measured["chat"]["16"], 16)
        assert measured["stream"]["8"]["errors"] == 0
        assert cell["chat_ratio"] > 0 and cell["stream_ratio"] > 0
    assert "surfaces" not in servers["granian-x2"]
    # The reference: chat at c=16 only, with the same load.
    bare = servers["bare-daphne"]
    assert set(bare["chat"]) == {"16"}
    _assert_chat_cell(bare["chat"]["16"], 16)
    assert bare["paced_stream"] is None

    _assert_multi_process_target_sums_its_processes(servers["granian-x2"])

    verdicts = {(g["server"], g["goal"]): g for g in report["goals"]}
    assert {server for server, _ in verdicts} == {"daphne", "granian-x2"}
    daphne_goals = [v for (server, _), v in verdicts.items() if server == "daphne"]
    assert len(daphne_goals) == 7  # all of Daphne's but LiteLLM's (not measured)
    for verdict in daphne_goals:
        assert verdict["value"] is not None
        assert verdict["status"] in ("PASS", "MISS")
    speedup = verdicts[("granian-x2", "throughput c=16 / one process's")]
    assert speedup["status"] == "NOT MEASURED"  # one granian process was not run
    assert "granian not measured" in speedup["note"]

    table = capsys.readouterr().out
    for line in (
        "bare-daphne",
        "granian-x2",
        "Goals (issue 11)",
        "new streams",
        "translated (Anthropic client, OpenAI backend)",
        "goal (issue 14): translated non-stream",
    ):
        assert line in table
    assert "throughput c=16 / bare-daphne's" in table
    # The run cleans up after itself.
    assert not Backend.objects.filter(name=BACKEND_NAME).exists()
    assert not Backend.objects.filter(name=ANTHROPIC_BACKEND).exists()
    assert not ApiKey.objects.filter(name=KEY_NAME, is_active=True).exists()


def _assert_chat_cell(cell: dict[str, Any], connections: int) -> None:
    assert cell["connections"] == connections
    assert cell["requests_per_s"] > 0
    assert cell["errors"] == 0


def _assert_multi_process_target_sums_its_processes(data: dict[str, Any]) -> None:
    # granian's main process runs two workers as its children: three processes,
    # the workers' CPU and memory counted with the main one's.
    assert data["target"]["processes"] == 2
    assert not data["target"]["pinned"]
    assert len(data["processes"]) == 3
    assert data["peak_rss_kib"] == max(p["peak_rss_kib"] for p in data["processes"])
    assert data["rss_end_kib"] == sum(p["rss_kib"] for p in data["processes"])
    assert set(data["chat"]) == {"16", "64"}
    cell = data["chat"]["16"]
    _assert_chat_cell(cell, 16)
    assert cell["latency_ms"]["samples"] == 0  # wrk alone: no Python probe
    shares = cell["server_cpu_percent_by_process"]
    assert len(shares) == 3
    assert sorted(shares.values())[-2] > 0, "both workers served requests"
    assert sum(shares.values()) == pytest.approx(cell["cpu_percent"]["server"], abs=1)
    assert cell["cpu_ms_per_request"]["server"] > 0


@pytest.mark.django_db
def test_unknown_server_is_refused_with_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--servers", "gunicorn"])
    assert exited.value.code == 2
    assert "--servers takes some of bare-daphne, daphne, uvicorn, granian, " in (
        capsys.readouterr().err
    )


@pytest.mark.django_db
def test_duration_below_one_second_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--duration", "0"])
    assert exited.value.code == 2
    assert "--duration must be at least 1" in capsys.readouterr().err


def test_python_m_tests_bench_sets_up_django_and_checks_its_options() -> None:
    finished = subprocess.run(
        [sys.executable, "-m", "tests.bench", "--duration", "0"],
        cwd=REPO_ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert finished.returncode == 2, finished.stderr
    assert "--duration must be at least 1" in finished.stderr


def test_a_process_group_counts_the_cpu_and_memory_of_its_children(
    tmp_path: Path,
) -> None:
    # Like granian: the started process does little; its child does the work.
    burn = (
        "import time\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\n"
        "time.sleep(30)"
    )
    parent = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {burn!r}])\n"
        "time.sleep(30)"
    )
    root = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    group = ProcessGroup("tree", [root], [tmp_path / "none.log"])
    try:
        deadline = time.monotonic() + 20
        while True:
            by_process = group.cpu_seconds_by_process()
            children = [pid for pid in by_process if pid != root.pid]
            if children and by_process[children[0]] >= 0.3:
                break  # the child has (about) finished burning
            assert time.monotonic() < deadline, by_process
            time.sleep(0.05)
        child = children[0]
        assert group.pids() == [root.pid, child]
        assert group.cpu_seconds() == pytest.approx(sum(by_process.values()), abs=0.05)
        assert group.cpu_seconds() - by_process[root.pid] >= 0.3
        assert set(group.memory_kib()) == {root.pid, child}
    finally:
        group.stop()
    assert root.poll() is not None
    # Stopping the group stops the child too (it may be a zombie for a moment).
    deadline = time.monotonic() + 5
    while _is_alive(child):
        assert time.monotonic() < deadline, f"child {child} outlived its group"
        time.sleep(0.05)


def _is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_n_process_targets_take_their_count_from_workers() -> None:
    targets = parse_targets(["bare-daphne", "daphne", "uvicorn-xN", "granian-x3"], 4)
    assert [(t.label, t.server, t.workers, t.role) for t in targets] == [
        ("bare-daphne", "daphne", 1, "reference"),
        ("daphne", "daphne", 1, "nexus"),
        ("uvicorn-x4", "uvicorn", 4, "nexus"),
        ("granian-x3", "granian", 3, "nexus"),
    ]
    with pytest.raises(ValueError, match="gunicorn"):
        parse_targets(["gunicorn-xN"], 2)


def test_a_default_run_is_estimated_at_four_minutes_at_most() -> None:
    targets = parse_targets(list(DEFAULT_TARGETS), 2)
    options = BenchOptions(targets=targets)
    assert estimate_seconds(options) <= 4 * 60
    assert {t.label for t in targets} >= {"daphne", "uvicorn", "granian", "daphne-x2"}


def test_profile_summary_ranks_frames_by_self_and_inclusive_samples(
    tmp_path: Path,
) -> None:
    entry = 'process 7:"python -m daphne";main (cli.py:1);run_forever (loop.py:5)'
    profile = tmp_path / "profile.txt"
    profile.write_text(
        f"{entry};handle (proxy.py:10);forward (upstream.py:3) 6\n"
        f"{entry};handle (proxy.py:10);record (proxy.py:40) 2\n"
        f"{entry};select (selectors.py:9) 2\n"
    )
    summary = summarize_profile(profile)
    assert summary["samples"] == 10
    assert [(f["frame"], f["percent"]) for f in summary["top_self"]] == [
        ("forward (upstream.py:3)", 60.0),
        ("record (proxy.py:40)", 20.0),
        ("select (selectors.py:9)", 20.0),
    ]
    # The entry chain (each frame calling one frame only) is not ranked.
    assert summary["trunk"] == ["main (cli.py:1)"]
    inclusive = {f["frame"]: f["percent"] for f in summary["top_inclusive"]}
    assert inclusive["run_forever (loop.py:5)"] == 100.0
    assert inclusive["handle (proxy.py:10)"] == 80.0
    assert "main (cli.py:1)" not in inclusive


@pytest.mark.django_db
def test_litellm_must_be_an_executable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--litellm", "/nonexistent/bin/litellm"])
    assert exited.value.code == 2
    assert "make bench-peers installs LiteLLM" in capsys.readouterr().err
