"""`make bench` (tests.bench) in smoke mode: real mock, Daphne, uvicorn and wrk.

These tests check that the benchmark runs end to end and reports every figure
it promises, never how fast anything is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from backends.models import Backend
from tests.bench.cli import main
from tests.bench.database import BACKEND_NAME, KEY_NAME
from tests.conftest import REPO_ROOT
from usage.models import ApiKey

needs_wrk = pytest.mark.skipif(
    shutil.which("wrk") is None, reason="needs wrk (Debian: apt-get install wrk)"
)


def _assert_percentiles(summary: dict[str, float | int | None]) -> None:
    assert summary["samples"] > 0
    assert 0 < summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]


@needs_wrk
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_smoke_run_reports_every_figure_for_both_servers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--duration", "1", "--quick", "--output", str(tmp_path)]) == 0

    report = json.loads((tmp_path / "latest.json").read_text())
    assert list(tmp_path.glob("bench-*.json")), "a timestamped copy is kept too"
    # The report says which settings the serving processes ran with.
    mode = "production" if settings.NEXUS_PRODUCTION else "embedded"
    assert report["environment"]["settings"].startswith(f"{mode} ({connection.vendor}")
    assert set(report["servers"]) == {"daphne", "uvicorn"}
    for data in [report["direct"], *report["servers"].values()]:
        assert set(data["chat"]) == {"1", "16", "64"}
        for concurrency, cell in data["chat"].items():
            assert cell["connections"] == int(concurrency)
            assert cell["requests_per_s"] > 0
            assert cell["errors"] == 0
            _assert_percentiles(cell["latency_ms"])
        assert set(data["stream"]) == {"1", "8"}
        for stream in data["stream"].values():
            assert stream["streams_per_s"] > 0
            assert stream["errors"] == 0
            _assert_percentiles(stream["ttfb_ms"])
            _assert_percentiles(stream["stream_ms"])
            assert stream["ttfb_ms"]["p50"] <= stream["stream_ms"]["p50"]
    for name, data in report["servers"].items():
        assert data["peak_rss_kib"] >= data["rss_end_kib"] > 0
        assert data["chat"]["16"]["cpu_percent"]["server"] > 0
        assert set(report["comparison"][name]["chat"]) == {"1", "16", "64"}
        ratio = report["comparison"][name]["chat"]["16"]["throughput_ratio"]
        assert ratio > 0
    verdicts = {(g["server"], g["goal"]): g for g in report["goals"]}
    assert len(verdicts) == 8  # four goals for each of the two servers
    for verdict in verdicts.values():
        assert verdict["value"] is not None
        assert verdict["status"] in ("PASS", "MISS")

    table = capsys.readouterr().out
    for line in ("via daphne", "via uvicorn", "Goals (issue 6)", "peak RSS"):
        assert line in table
    assert "added p50 latency, chat c=1" in table
    # The run cleans up after itself.
    assert not Backend.objects.filter(name=BACKEND_NAME).exists()
    assert not ApiKey.objects.filter(name=KEY_NAME, is_active=True).exists()


@pytest.mark.django_db
def test_unknown_server_is_refused_with_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--servers", "gunicorn"])
    assert exited.value.code == 2
    assert "--servers takes some of daphne, uvicorn" in capsys.readouterr().err


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
