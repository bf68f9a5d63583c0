"""The admin in a real browser: log in and find the backends an operator has."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect, sync_playwright

from tests.factories import BackendFactory

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
USERNAME = "operator"
PASSWORD = "op-password-9431"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium"),
]


@contextmanager
def open_page() -> Iterator[Page]:
    """Open a headless chromium page.

    Playwright's sync API runs an event loop in this thread while it is open, and
    Django refuses ORM calls beside a running loop: set up data before opening.
    """
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(viewport={"width": 1600, "height": 900})
            yield context.new_page()
        finally:
            browser.close()


def test_operator_logs_in_and_sees_the_demo_backend(
    transactional_db: None, live_server: Any
) -> None:
    User.objects.create_superuser(USERNAME, "op@example.com", PASSWORD)
    BackendFactory(name="demo-alpha", is_demo=True, avg_latency_ms=42.0)
    BackendFactory(name="gpu-rack-1", unhealthy=True)

    with open_page() as page:
        page.goto(f"{live_server.url}/admin/")
        page.fill("#id_username", USERNAME)
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        expect(page.locator("#site-name")).to_contain_text("Nexus administration")
        page.locator('#content-main a[href="/admin/backends/backend/"]').first.click()

        expect(page).to_have_url(f"{live_server.url}/admin/backends/backend/")
        rows = page.locator("#result_list tbody tr")
        expect(rows).to_have_count(2)
        demo_row = rows.filter(has_text="demo-alpha")
        expect(demo_row).to_contain_text("DEMO")
        expect(demo_row).to_contain_text("Healthy")
        expect(demo_row).to_contain_text("42 ms")
        other_row = rows.filter(has_text="gpu-rack-1")
        expect(other_row).to_contain_text("Unhealthy")
        expect(other_row).not_to_contain_text("DEMO")

        ARTIFACTS.mkdir(exist_ok=True)
        screenshot = ARTIFACTS / "admin-backends.png"
        page.screenshot(path=str(screenshot), full_page=True)

    assert screenshot.stat().st_size > 0
