"""The dashboard in a real browser: numbers move when traffic flows, no reload."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import Page, expect, sync_playwright

from backends.models import Backend, BackendModel, HealthStatus
from routing.models import RoutingPolicy
from tests import zygote
from tests.conftest import REPO_ROOT, MockBackendProcess, NexusServer, server_env
from tests.factories import UsageBucketFactory
from usage.models import ApiKey
from usage.stream import clear_usage_stream

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
USERNAME = "dash-operator"
PASSWORD = "dash-password-5127"
MODEL = "llama3:8b"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium"),
    pytest.mark.django_db(transaction=True),
]


@contextmanager
def open_page() -> Iterator[Page]:
    """Open a headless chromium page (set up data first: see test_admin_browser)."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 800})
            yield context.new_page()
        finally:
            browser.close()


def test_dashboard_shows_a_chat_request_without_reload(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    if settings.NEXUS_USAGE_TRANSPORT == "redis":
        clear_usage_stream()  # events other tests' servers left behind
    mock = mock_backend_factory("--models", MODEL, "--name", "mock-dash")
    backend = Backend.objects.create(
        name="mock-dash",
        base_url=mock.base_url,
        status=HealthStatus.HEALTHY,
        avg_latency_ms=12.0,
    )
    BackendModel.objects.create(backend=backend, name=MODEL)
    Backend.objects.create(
        name="gpu-rack-2",
        base_url="http://127.0.0.1:9",
        status=HealthStatus.UNHEALTHY,
        # Its server's prompt cache (vLLM's counters, read on the health round).
        prefix_cache_hits=3_000,
        prefix_cache_queries=4_000,
    )
    # Healthy an hour ago, unchecked since (beat stopped): routed as unknown.
    Backend.objects.create(
        name="gpu-quiet",
        base_url="http://127.0.0.1:9",
        status=HealthStatus.HEALTHY,
        last_check_at=timezone.now() - timedelta(hours=1),
    )
    _, key = ApiKey.objects.create_key("dashboard-browser")
    # Earlier traffic, already rolled up into a per-minute bucket.
    UsageBucketFactory(
        minute=timezone.now() - timedelta(minutes=10),
        backend="mock-dash",
        model=MODEL,
        requests=5,
        total_tokens=70,
    )
    User.objects.create_superuser(USERNAME, "dash@example.com", PASSWORD)
    # Production settings expect collectstatic (the Docker image runs it);
    # serve the dashboard's script and styles straight from the app instead.
    server = nexus_server_factory(WHITENOISE_USE_FINDERS="true")
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    env = server_env()  # read before the browser's event loop runs

    with open_page() as page:
        page.goto(f"{server.base_url}/dashboard/")
        expect(page).to_have_url(f"{server.base_url}/admin/login/?next=/dashboard/")
        page.fill("#id_username", USERNAME)
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        expect(page).to_have_url(f"{server.base_url}/dashboard/")

        # The socket connects in well under a second on an idle machine; a CI
        # run on a slow, loaded one was still connecting after the default 5 s.
        expect(page.locator("#connection")).to_have_text("live", timeout=20_000)
        # The rolled-up traffic counts too: a restart does not empty the page.
        expect(page.locator("#total-requests")).to_have_text("5")
        expect(page.locator("#total-tokens")).to_have_text("70")
        backends = page.locator("#backends tbody tr")
        expect(backends.filter(has_text="mock-dash")).to_contain_text("healthy")
        expect(backends.filter(has_text="gpu-rack-2")).to_contain_text("unhealthy")
        expect(backends.filter(has_text="gpu-rack-2")).to_contain_text("75 %")
        expect(backends.filter(has_text="gpu-rack-2").locator(".stale")).to_have_count(
            0
        )
        quiet = backends.filter(has_text="gpu-quiet").locator(".stale")
        expect(quiet).to_have_text("stale")
        expect(quiet).to_have_attribute("title", re.compile("treated as unknown"))
        expect(backends.filter(has_text="mock-dash").locator(".stale")).to_have_count(0)
        expect(page.locator("#history-hour-summary")).to_contain_text(
            "5 requests, 70 tokens (top: llama3:8b 70)"
        )
        expect(page.locator("#history-day-summary")).to_contain_text("5 requests")
        # Charts with time axes and titles (plotly.js, served by Nexus).
        hour = page.locator("#history-hour")
        expect(hour.locator(".g-ytitle")).to_have_text("requests / minute")
        expect(hour.locator(".g-xtitle")).to_have_text("time")
        expect(hour.locator(".xtick").first).to_have_text(_CLOCK)
        expect(page.locator("#history-day .g-ytitle")).to_have_text("requests / 15 min")
        live = page.locator("#live-chart")
        expect(live.locator(".g-ytitle")).to_have_text("requests / s")
        # The five-minute chart spans five minutes from the first second.
        assert _x_range_seconds(page, "live-chart") == pytest.approx(300, abs=2)
        assert _x_range_seconds(page, "history-hour") == pytest.approx(3600, abs=61)

        reply = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello dashboard"}]
        )
        assert reply.usage is not None

        tokens = 70 + reply.usage.total_tokens
        expect(page.locator("#total-requests")).to_have_text("6")
        expect(page.locator("#total-tokens")).to_have_text(f"{tokens:,}")
        # Every token of the last minute is the new request's.
        expect(page.locator("#token-rate")).to_have_text(
            f"{reply.usage.total_tokens:,}"
        )
        row = page.locator(f'#models tbody tr[data-model="{MODEL}"]')
        expect(row).to_be_visible()
        expect(row.locator("td").nth(2)).to_contain_text("ms")  # p50 latency
        # One request over the one-minute window: 1/60 per second.
        expect(page.locator("#request-rate")).to_have_text("0.02")
        expect(page.locator("#error-rate")).to_have_text("0.0 %")
        expect(live_peak := page.locator("#live-chart-label")).to_have_text(
            "peak 0.10 req/s"  # one request in a 10-second slot
        )
        del live_peak

        # The rollup runs (as beat would): the history shows the request
        # without a reload, and the totals do not count it twice.
        summary = page.locator("#history-hour-summary")
        deadline = time.monotonic() + 30
        while "6 requests" not in (summary.text_content() or ""):
            assert time.monotonic() < deadline, summary.text_content()
            _roll_up(env)
            page.wait_for_timeout(500)  # the page polls every 10 s; let it
        expect(page.locator("#total-requests")).to_have_text("6")
        expect(hour.locator(".point")).not_to_have_count(0)
        # The tooltip of the latest minute with requests. Plotly is asked to
        # hover that bar (as the pointer would) and its label is read in the same
        # turn of the page's loop: the page redraws its charts every 10 s, which
        # clears a tooltip, and on a loaded machine a pointer moved from the test
        # raced those redraws.
        hover_latest = """(chart) => {
            const y = chart.data[0].y;
            let i = y.length - 1;
            while (i > 0 && !y[i]) i--;
            Plotly.Fx.hover(chart, [{curveNumber: 0, pointNumber: i}]);
            return chart.querySelector(".hoverlayer").textContent;
        }"""
        deadline = time.monotonic() + 20
        while "requests: 1" not in (label := hour.evaluate(hover_latest)):
            assert time.monotonic() < deadline, label
            page.wait_for_timeout(300)
        assert f"tokens: {reply.usage.total_tokens}" in label  # the new request's

        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-1280.png"))


_CLOCK = __import__("re").compile(r"\d{1,2}:\d{2}")


def _x_range_seconds(page: Any, element_id: str) -> float:
    return float(
        page.evaluate(
            """id => {
                const range = document.getElementById(id).layout.xaxis.range;
                return (Date.parse(range[1]) - Date.parse(range[0])) / 1000;
            }""",
            element_id,
        )
    )


def _roll_up(env: dict[str, str]) -> None:
    """Write shipped usage and roll it up, as Celery beat does every 10 s."""
    zygote.run(
        [sys.executable, "manage.py", "nexus_flush_usage"],
        cwd=REPO_ROOT,
        env=env,
        check=True,
        timeout=60,
    )


def test_dashboard_shows_admission_queues_bands_and_refusals_live(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    # One slot that stays busy; at most 1 in flight, 3 waiting, 2 per flow.
    mock = mock_backend_factory(
        "--models", MODEL, "--name", "one-slot", "--slots", "1", "--latency-ms", "60000"
    )
    backend = Backend.objects.create(
        name="one-slot", base_url=mock.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name=MODEL)
    policy = RoutingPolicy.load()
    policy.admission_lower_bound_per_backend = 1.0
    policy.admission_upper_bound_per_backend = 1.0
    policy.admission_total_capacity = 3
    policy.admission_flow_capacity = 2
    policy.admission_critical_reserved = 0
    policy.full_clean()
    policy.save()
    flood, flood_key = ApiKey.objects.create_key("flood")
    light, light_key = ApiKey.objects.create_key("light")
    User.objects.create_superuser(USERNAME, "dash@example.com", PASSWORD)
    # Its requests are held by the mock until the end: stop without a long drain.
    server = nexus_server_factory(
        WHITENOISE_USE_FINDERS="true", NEXUS_DRAIN_SECONDS="1"
    )
    workers = ThreadPoolExecutor(max_workers=6)

    def send(key: str, criticality: str = "default") -> Future[httpx.Response]:
        return workers.submit(
            httpx.post,
            f"{server.base_url}/v1/chat/completions",
            headers={
                "Authorization": f"Bearer {key}",
                "X-Nexus-Criticality": criticality,
            },
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            timeout=90,
        )

    try:
        with open_page() as page:
            _log_in(page, server)
            expect(page.locator("#connection")).to_have_text("live", timeout=20_000)
            expect(page.locator("#admission-pools tbody")).to_contain_text(
                "No admitted requests yet."
            )
            pool = page.locator('#admission-pools tbody tr[data-backends="one-slot"]')
            flows = page.locator("#admission-flows tbody")

            send(flood_key, "sheddable")  # straight through: the slot is busy
            expect(pool.locator(".stock")).to_have_text("1")
            expect(pool).to_contain_text(MODEL)
            expect(pool).to_contain_text("1.0–1.0")
            expect(pool.locator("meter")).to_have_attribute("value", "1")
            queued = [send(flood_key, "sheddable") for _ in range(2)]
            expect(flows.locator(f'tr[data-flow="{flood.prefix}"]')).to_contain_text(
                "2"
            )
            over = send(flood_key, "sheddable").result(timeout=30)
            assert over.json()["error"]["code"] == "flow_queue_full"
            send(light_key)  # the queue is full now (3)...
            expect(pool.locator(".waiting")).to_have_text("3")
            send(light_key)  # ...so this one sheds the flood's newest request
            # (Sent at once, either of the two may be the newer.)
            done, _ = wait(queued, timeout=30, return_when=FIRST_COMPLETED)
            assert [f.result().json()["error"]["code"] for f in done] == ["preempted"]

            expect(flows.locator(f'tr[data-flow="{light.prefix}"]')).to_contain_text(
                "2"
            )
            expect(flows.locator(f'tr[data-flow="{flood.prefix}"]')).to_contain_text(
                "1"
            )
            expect(pool.locator(".waiting")).to_have_text("3")
            refusals = page.locator("#admission-rejections tbody")
            expect(
                refusals.locator('tr[data-reason="flow_queue_full"]')
            ).to_contain_text("flow's queue full (503)1")
            expect(refusals.locator('tr[data-reason="preempted"]')).to_contain_text("1")
            expect(
                page.locator('#admission-preemptions tr[data-reason="sheddable"]')
            ).to_contain_text("1")
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator("#admission").screenshot(
                path=str(ARTIFACTS / "dashboard-admission.png")
            )
    finally:
        # The requests still held by the mock end with the servers.
        workers.shutdown(wait=False, cancel_futures=True)


def _log_in(page: Page, server: NexusServer) -> None:
    page.goto(f"{server.base_url}/dashboard/")
    page.fill("#id_username", USERNAME)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    expect(page).to_have_url(f"{server.base_url}/dashboard/")
