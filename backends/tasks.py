"""Celery tasks of the backends app: thin wrappers over health and discovery."""

from __future__ import annotations

from celery import shared_task

from backends.discovery import discover_models
from backends.health import check_all, record_breaker_opening


@shared_task(ignore_result=True)
def check_backends_health() -> None:
    """Run one health round; list the models of backends that just came up."""
    recovered = [report.backend_id for report in check_all() if report.recovered]
    if recovered:
        discover_models(recovered)


@shared_task(ignore_result=True)
def discover_backend_models() -> None:
    discover_models()


@shared_task(ignore_result=True)
def persist_breaker_opening(backend_name: str, detail: str) -> None:
    record_breaker_opening(backend_name, detail)
