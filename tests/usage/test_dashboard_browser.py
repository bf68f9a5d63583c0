"""The dashboard in a real browser: numbers move when traffic flows, no reload."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import openai
import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import Page, expect, sync_playwright

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import MockBackendProcess, NexusServer
from tests.factories import UsageBucketFactory
from usage.models import ApiKey

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
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            yield context.new_page()
        finally:
            browser.close()


def test_dashboard_shows_a_chat_request_without_reload(
    mock_backend_factory: Callable[..., MockBackendProcess],
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    mock = mock_backend_factory("--models", MODEL, "--name", "mock-dash")
    backend = Backend.objects.create(
        name="mock-dash",
        base_url=mock.base_url,
        status=HealthStatus.HEALTHY,
        avg_latency_ms=12.0,
    )
    BackendModel.objects.create(backend=backend, name=MODEL)
    Backend.objects.create(
        name="gpu-rack-2", base_url="http://127.0.0.1:9", status=HealthStatus.UNHEALTHY
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

    with open_page() as page:
        page.goto(f"{server.base_url}/dashboard/")
        expect(page).to_have_url(f"{server.base_url}/admin/login/?next=/dashboard/")
        page.fill("#id_username", USERNAME)
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        expect(page).to_have_url(f"{server.base_url}/dashboard/")

        expect(page.locator("#connection")).to_have_text("live")
        expect(page.locator("#total-requests")).to_have_text("0")
        backends = page.locator("#backends tbody tr")
        expect(backends.filter(has_text="mock-dash")).to_contain_text("healthy")
        expect(backends.filter(has_text="gpu-rack-2")).to_contain_text("unhealthy")
        expect(page.locator("#history-hour-summary")).to_contain_text(
            "5 requests, 70 tokens (top: llama3:8b 70)"
        )
        expect(page.locator("#history-hour rect.bar")).to_have_count(1)
        expect(page.locator("#history-day-summary")).to_contain_text("5 requests")

        reply = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello dashboard"}]
        )
        assert reply.usage is not None

        expect(page.locator("#total-requests")).to_have_text("1")
        tokens = f"{reply.usage.total_tokens:,}"
        expect(page.locator("#total-tokens")).to_have_text(tokens)
        # Every token so far fell within the last minute.
        expect(page.locator("#token-rate")).to_have_text(tokens)
        row = page.locator(f'#models tbody tr[data-model="{MODEL}"]')
        expect(row).to_be_visible()
        expect(row.locator("td").nth(2)).to_contain_text("ms")  # p50 latency
        # One request over the one-minute window: 1/60 per second.
        expect(page.locator("#request-rate")).to_have_text("0.02")
        expect(page.locator("#error-rate")).to_have_text("0.0 %")

        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
