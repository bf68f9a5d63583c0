"""List what each backend serves and update its models (the beat task, on demand)."""

from __future__ import annotations

from collections.abc import Sequence

from backends.discovery import DiscoveryReport, discover_models
from backends.management.rounds import BackendRoundCommand, format_columns


class Command(BackendRoundCommand[DiscoveryReport]):
    help = (
        "Ask every enabled backend (or --backend NAME, even a disabled one) which "
        "models it serves, and add, update, disable or re-enable their rows. "
        "Fields set by hand in the admin are kept. Exits with status 1 when a "
        "backend could not be listed."
    )
    backend_help = "Discover only this backend's models."
    nothing_to_do = "No enabled backends to ask."
    failure_label = "Could not list"

    def run_round(
        self, backend_ids: list[int] | None, *, include_disabled: bool
    ) -> list[DiscoveryReport]:
        return discover_models(backend_ids, include_disabled=include_disabled)

    def format_reports(self, reports: Sequence[DiscoveryReport]) -> list[str]:
        return format_columns((r.name, r.summary()) for r in reports)

    def failed(self, reports: Sequence[DiscoveryReport]) -> list[str]:
        return [r.name for r in reports if not r.ok]
