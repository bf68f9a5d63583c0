"""Demo mode: built-in mock backends that make a fresh install usable at once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from django.db import transaction

from backends.models import Backend, BackendKind, BackendModel, HealthStatus
from nexus_site.mock_backend import MockBackendProcess, spawn_mock_backend
from usage.models import ApiKey

DEMO_KEY_NAME = "demo"


@dataclass(frozen=True)
class DemoModel:
    name: str
    context_length: int
    vision: bool = False
    tools: bool = False
    json_mode: bool = False


@dataclass(frozen=True)
class DemoBackend:
    name: str
    priority: int
    models: tuple[DemoModel, ...]
    # An "ollama" mock also answers Ollama's native API, so Ollama clients'
    # requests to it are passed through rather than translated.
    kind: str = BackendKind.OPENAI


DEMO_BACKENDS = (
    DemoBackend(
        name="demo-alpha",
        priority=1,
        models=(
            DemoModel("llama3:8b", 8192, tools=True, json_mode=True),
            DemoModel("mistral:7b", 32768, json_mode=True),
        ),
    ),
    DemoBackend(
        name="demo-beta",
        priority=2,
        models=(
            DemoModel("llama3:8b", 8192, tools=True, json_mode=True),
            DemoModel("llava:7b", 4096, vision=True),
        ),
        kind=BackendKind.OLLAMA,
    ),
)


def spawn_demo_mock(spec: DemoBackend) -> MockBackendProcess:
    """Start the mock backend that plays ``spec``, slow enough to look real.

    Its stdout stays an open pipe for the launcher to relay.
    """
    return spawn_mock_backend(
        "--name",
        spec.name,
        "--kind",
        spec.kind,
        "--models",
        ",".join(model.name for model in spec.models),
        "--vision-models",
        ",".join(model.name for model in spec.models if model.vision),
        "--tool-models",
        ",".join(model.name for model in spec.models if model.tools),
        "--latency-ms",
        "20",
        "--chunk-delay-ms",
        "30",
        # The launcher, not the terminal's Ctrl-C, stops it.
        new_session=True,
    )


@transaction.atomic
def register_demo_backend(spec: DemoBackend, base_url: str) -> Backend:
    """Create or update the demo backend row to point at a running mock."""
    backend, _ = Backend.objects.update_or_create(
        name=spec.name,
        defaults={
            "base_url": base_url,
            "kind": spec.kind,
            "priority": spec.priority,
            "enabled": True,
            "is_demo": True,
            # The mock answered a moment ago; health checks take over from here.
            "status": HealthStatus.HEALTHY,
            "last_error": "",
            "consecutive_failures": 0,
        },
    )
    for model in spec.models:
        BackendModel.objects.update_or_create(
            backend=backend,
            name=model.name,
            defaults={
                "context_length": model.context_length,
                "supports_vision": model.vision,
                "supports_tools": model.tools,
                "supports_json_mode": model.json_mode,
                "loaded": True,
                "enabled": True,
            },
        )
    return backend


def disable_demo_backends() -> int:
    """Stop routing to demo backends (their mock processes are not running)."""
    count = Backend.objects.filter(is_demo=True, enabled=True).update(enabled=False)
    if count:
        Backend.objects.announce_change()  # a bulk update sends no signals
    return count


def is_demo_wanted(explicit: bool | None) -> bool:
    """Demo mode is on by default until the operator has backends of their own."""
    if explicit is not None:
        return explicit
    return not Backend.objects.filter(is_demo=False).exists()


def ensure_demo_api_key(state_dir: Path) -> str:
    """Return the demo client key, kept in the state directory across runs."""
    path = state_dir / "demo_api_key"
    if path.exists():
        raw = path.read_text(encoding="ascii").strip()
        if ApiKey.objects.for_raw_key(raw) is not None:
            return raw
    _, raw = ApiKey.objects.create_key(DEMO_KEY_NAME)
    path.touch(mode=0o600)
    path.write_text(raw + "\n", encoding="ascii")
    return raw
