"""Model discovery: ask each backend what it serves and upsert BackendModel rows.

``discover_models()`` lists every enabled backend's models concurrently (the
kind adapters in ``backends.kinds`` know how), then, one backend at a time and
with its row locked (two runs at once apply one after the other):

- a model seen for the first time gets a row marked ``discovered``;
- a known model gets the capabilities the backend reported, except the fields
  in its ``manual_fields`` (set by hand in the admin), which are never
  overwritten. A row added by hand and now found on the backend is adopted: its
  fields that differ from the defaults count as set by hand;
- a discovered model the backend no longer lists is disabled, not deleted, and
  enabled again when it reappears, unless the operator set ``enabled`` by hand;
- a backend that cannot be listed (down, loading, models from configuration)
  keeps its rows untouched.

The run commits once at the end, and announces any change to the apps above
(which bump the routing config version once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypedDict

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from backends.kinds import BackendKindAdapter, Endpoint, ModelInfo
from backends.kinds.calls import call_backends
from backends.models import (
    DISCOVERED_FIELDS,
    LOADED_FIELDS,
    OPERATOR_FIELDS,
    Backend,
    BackendModel,
)

logger = logging.getLogger(__name__)


class DiscoveryReportDict(TypedDict):
    """One backend's discovery, as ``nexus_discover_models --json`` prints it."""

    name: str
    kind: str
    ok: bool
    error: str
    note: str
    models: list[str]
    added: list[str]
    updated: list[str]
    disabled: list[str]
    enabled: list[str]


@dataclass
class DiscoveryReport:
    """What discovery found on one backend and changed in the database."""

    backend_id: int
    name: str
    kind: str
    ok: bool = True
    error: str = ""
    # Set when the kind has no model listing (its models come from configuration).
    note: str = ""
    models: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    enabled: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.updated or self.disabled or self.enabled)

    def summary(self) -> str:
        """One line for people: what was found and what changed."""
        if not self.ok:
            return f"not listed: {self.error}"
        if self.note:
            return self.note
        parts = [f"{len(self.models)} model{'s' if len(self.models) != 1 else ''}"]
        for label, names in (
            ("added", self.added),
            ("updated", self.updated),
            ("disabled", self.disabled),
            ("re-enabled", self.enabled),
        ):
            if names:
                parts.append(f"{label} {', '.join(names)}")
        return "; ".join(parts)

    def as_dict(self) -> DiscoveryReportDict:
        return {
            "name": self.name,
            "kind": self.kind,
            "ok": self.ok,
            "error": self.error,
            "note": self.note,
            "models": self.models,
            "added": self.added,
            "updated": self.updated,
            "disabled": self.disabled,
            "enabled": self.enabled,
        }


def discover_models(
    backend_ids: Iterable[int] | None = None, *, include_disabled: bool = False
) -> list[DiscoveryReport]:
    """List backends' models concurrently and upsert them (sync code only).

    Without ``backend_ids`` every enabled backend is asked; disabled ones only
    when named and ``include_disabled`` is set.
    """
    endpoints = Backend.objects.endpoints(
        backend_ids, include_disabled=include_disabled
    )
    if not endpoints:
        return []
    answers = asyncio.run(
        call_backends(
            endpoints,
            _list,
            timeout=settings.NEXUS_DISCOVERY_TIMEOUT,
            connections_per_backend=4,
            action="Listing models of",
        )
    )
    reports = []
    # One transaction, so that a run's changes bump the routing version once.
    with transaction.atomic():
        for pk, endpoint in endpoints.items():
            answer = answers[pk]
            report = DiscoveryReport(
                backend_id=pk, name=endpoint.name, kind=endpoint.kind
            )
            if answer.error:
                report.ok = False
                report.error = answer.error
            elif answer.value is None:
                report.note = "models come from the configuration for this kind"
            else:
                _apply(report, answer.value)
            reports.append(report)
    for report in reports:
        if report.changed:
            logger.info("Discovery on %s: %s", report.name, report.summary())
    return reports


async def _list(
    adapter: BackendKindAdapter, client: httpx.AsyncClient, endpoint: Endpoint
) -> list[ModelInfo] | None:
    """Return the backend's models, or None when its kind does not list them."""
    if not adapter.discovers_models:
        return None
    return await adapter.list_models(client, endpoint)


def record_models(
    backend_id: int, name: str, listing: list[ModelInfo]
) -> DiscoveryReport:
    """Record a model listing learnt another way (a relay worker's register)."""
    report = DiscoveryReport(backend_id=backend_id, name=name, kind="relay")
    with transaction.atomic():
        _apply(report, listing)
    return report


def _apply(report: DiscoveryReport, listing: list[ModelInfo]) -> None:
    """Upsert one backend's models with its row locked; fill in the report.

    Runs inside the caller's transaction (a savepoint), so the lock is held
    until the whole run commits.
    """
    seen: dict[str, ModelInfo] = {}
    for info in listing:
        seen.setdefault(info.name, info)
    report.models = sorted(seen)
    with transaction.atomic():
        locked = Backend.objects.select_for_update().filter(pk=report.backend_id)
        if not list(locked.values_list("pk", flat=True)):
            report.ok = False
            report.error = "the backend was deleted meanwhile"
            return
        existing = {
            row.name: row
            for row in BackendModel.objects.filter(backend_id=report.backend_id)
        }
        to_create: list[BackendModel] = []
        to_update: list[BackendModel] = []
        for name, info in seen.items():
            row = existing.get(name)
            if row is None:
                to_create.append(_new_row(report.backend_id, info))
                report.added.append(name)
            elif _update_row(row, info, report):
                to_update.append(row)
        for name, row in existing.items():
            if name in seen or not row.discovered:
                continue
            if row.enabled and "enabled" not in row.manual_fields:
                row.enabled = False
                row.loaded = False
                report.disabled.append(name)
                to_update.append(row)
        BackendModel.objects.bulk_create(to_create)
        BackendModel.objects.bulk_update(
            to_update,
            (*OPERATOR_FIELDS, "loaded", *LOADED_FIELDS, "discovered", "manual_fields"),
        )
        if to_create or to_update:
            # Bulk writes send no model signals.
            BackendModel.objects.announce_change()


def _new_row(backend_id: int, info: ModelInfo) -> BackendModel:
    values: dict[str, Any] = {
        name: getattr(info, name)
        for name in DISCOVERED_FIELDS
        if getattr(info, name) is not None
    }
    return BackendModel(
        backend_id=backend_id,
        name=info.name,
        discovered=True,
        enabled=True,
        loaded=bool(info.loaded),
        manual_fields=[],
        **values,
    )


def _update_row(row: BackendModel, info: ModelInfo, report: DiscoveryReport) -> bool:
    """Apply what the backend reported to an existing row; True if it changed."""
    changed = False
    if not row.discovered:
        # Added by hand before discovery saw it: whatever the operator set
        # (anything but a default) stays theirs.
        row.manual_fields = sorted(
            set(row.manual_fields) | set(_non_default_fields(row))
        )
        row.discovered = True
        changed = True
    manual = set(row.manual_fields)
    updated = False
    for name in DISCOVERED_FIELDS:
        value = getattr(info, name)
        if value is not None and name not in manual and getattr(row, name) != value:
            setattr(row, name, value)
            updated = True
    if info.loaded is not None and row.loaded != info.loaded:
        # As health rounds record it (BackendModel.objects.set_loaded): a load
        # or unload seen now, which the fleet strategy weighs against what
        # the proxy saw since (the latest observation wins).
        row.loaded = info.loaded
        row.last_loaded_at = timezone.now()
        if not info.loaded:
            row.vram_bytes = row.loaded_context_length = row.expires_at = None
        updated = True
    if updated:
        report.updated.append(row.name)
    if not row.enabled and "enabled" not in manual:
        row.enabled = True
        report.enabled.append(row.name)
        changed = True
    return changed or updated


def _non_default_fields(row: BackendModel) -> list[str]:
    defaults = BackendModel()
    return [
        name
        for name in OPERATOR_FIELDS
        if getattr(row, name) != getattr(defaults, name)
    ]
