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
            context = browser.new_context(viewport={"width": 1280, "height": 800})
            yield context.new_page()
        finally:
            browser.close()


def test_operator_logs_in_and_sees_the_demo_backend(
    transactional_db: None, live_server: Any
) -> None:
    User.objects.create_superuser(USERNAME, "op@example.com", PASSWORD)
    BackendFactory(name="demo-alpha", is_demo=True, avg_latency_ms=42.4)
    BackendFactory(name="gpu-rack-1", unhealthy=True)
    BackendFactory(
        name="OpenAI-Cloud",
        base_url="https://api.openai.example.com/some/long/prefix",
        kind="anthropic",
        avg_latency_ms=1234.567,
        draining=True,
    )
    ARTIFACTS.mkdir(exist_ok=True)

    with open_page() as page:
        page.goto(f"{live_server.url}/admin/")
        page.fill("#id_username", USERNAME)
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        expect(page.locator("#site-name")).to_contain_text("Nexus administration")
        # The dashboard and the API docs, in the header and on the index.
        expect(page.locator("#header-dashboard")).to_have_attribute(
            "href", "/dashboard/"
        )
        expect(page.locator("#header-api-docs")).to_have_attribute(
            "href", "/api/v1/docs/"
        )
        operate = page.locator("#nexus-operate")
        expect(operate.get_by_role("link", name="Live dashboard")).to_be_visible()
        expect(operate.get_by_role("link", name="Management API docs")).to_be_visible()
        # Two kinds of credential, named apart.
        content = page.locator("#content-main")
        expect(content).to_contain_text("Admin tokens (for scripts)")
        expect(content).to_contain_text("Client API keys (for /v1)")
        expect(content.locator("caption", has_text="Management API")).to_be_visible()
        page.screenshot(path=str(ARTIFACTS / "admin-index-1280.png"))
        page.locator('#content-main a[href="/admin/backends/backend/"]').first.click()

        expect(page).to_have_url(f"{live_server.url}/admin/backends/backend/")
        rows = page.locator("#result_list tbody tr")
        expect(rows).to_have_count(3)
        demo_row = rows.filter(has_text="demo-alpha")
        expect(demo_row).to_contain_text("DEMO")
        expect(demo_row).to_contain_text("Healthy")
        expect(demo_row).to_contain_text("42 ms")
        other_row = rows.filter(has_text="gpu-rack-1")
        expect(other_row).to_contain_text("Unhealthy")
        expect(other_row).not_to_contain_text("DEMO")
        cloud = rows.filter(has_text="OpenAI-Cloud")
        expect(cloud).to_contain_text("https://api.openai.example.com")
        expect(cloud).to_contain_text("1,235 ms")
        page.screenshot(path=str(ARTIFACTS / "admin-backends-1280.png"))
        # Every column fits a 1280 px screen: neither the page nor the list
        # scrolls sideways.
        assert page.evaluate(
            "document.documentElement.scrollWidth <= window.innerWidth"
        )
        results = page.locator("#changelist .results")
        assert results.evaluate("el => el.scrollWidth <= el.clientWidth")
        expect(page.locator("#result_list th.column-last_check_age")).to_be_in_viewport(
            ratio=1
        )

        # An action's message keeps the backend's name as typed.
        cloud.locator("input.action-select").check()
        page.select_option("select[name=action]", "drain")
        page.click("button[name=index]")
        expect(page.locator(".messagelist")).to_contain_text(
            "OpenAI-Cloud: was already draining."
        )

    for name in ("admin-index-1280.png", "admin-backends-1280.png"):
        assert (ARTIFACTS / name).stat().st_size > 0
