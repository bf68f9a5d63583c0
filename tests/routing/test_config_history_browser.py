"""The configuration history in a real browser: read a diff, revert."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import expect

from nexus_lib.authorship import VIA_API, ChangeAuthor, acting_as
from routing.history.recording import recording_changes
from routing.models import Alias, ConfigRevision, RoutingPolicy
from tests.test_admin_browser import ARTIFACTS, CHROMIUM, PASSWORD, USERNAME, open_page

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium"),
]


def test_an_operator_reads_a_change_and_reverts_it(
    transactional_db: None, live_server: Any
) -> None:
    User.objects.create_superuser(USERNAME, "op@example.com", PASSWORD)
    with acting_as(ChangeAuthor("bob", VIA_API)):
        with recording_changes():
            policy = RoutingPolicy.load()
            policy.max_retries = 3
            policy.save()
        target = ConfigRevision.objects.order_by("-number").first()
        assert target is not None
        with recording_changes():
            Alias.objects.create(name="gpt-4", target="llama3:8b")
    ARTIFACTS.mkdir(exist_ok=True)

    with open_page() as page:
        page.goto(f"{live_server.url}/admin/routing/configrevision/")
        page.fill("#id_username", USERNAME)
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        rows = page.locator("#result_list tbody tr")
        newest = rows.first
        expect(newest).to_contain_text("bob")
        expect(newest).to_contain_text('routing.aliases.gpt-4: added "llama3:8b"')
        page.screenshot(path=str(ARTIFACTS / "admin-config-history-1280.png"))
        assert page.evaluate(
            "document.documentElement.scrollWidth <= window.innerWidth"
        )

        rows.filter(has_text="routing.max_retries: 2 → 3").locator("a").first.click()
        table = page.locator("table.config-diff")
        expect(table).to_contain_text("routing.max_retries")
        page.get_by_role("link", name="Revert to this version").click()

        preview = page.locator("table.config-diff")
        expect(preview).to_contain_text("routing.aliases.gpt-4")
        expect(preview).to_contain_text("removed")
        page.screenshot(path=str(ARTIFACTS / "admin-config-revert-1280.png"))
        page.get_by_role("button", name=f"Revert to version {target.number}").click()
        expect(page.locator(".messagelist")).to_contain_text(
            f"Reverted to version {target.number}"
        )

    assert not Alias.objects.filter(name="gpt-4").exists()
    revert = ConfigRevision.objects.order_by("-number").first()
    assert revert is not None
    assert (revert.author, revert.via, revert.reverted_to) == (
        USERNAME,
        "revert",
        target.number,
    )
