"""Demo mode: built-in mock backends that make a fresh install usable at once."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import transaction

from backends.models import Backend, BackendKind, BackendModel, HealthStatus
from usage.models import ApiKey

READY_LINE = re.compile(r"listening on (http://\S+)")
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
    ),
)


def spawn_mock_backend(
    name: str, models: list[str], *extra_args: str, host: str = "127.0.0.1"
) -> tuple[subprocess.Popen[str], str]:
    """Start ``nexus_mock_backend`` on a free port; return the process and its URL.

    The child's stdout stays open: the caller must keep reading it, or a chatty
    child would block on a full pipe.
    """
    process = subprocess.Popen(
        [
            sys.executable,
            str(Path(settings.BASE_DIR) / "manage.py"),
            "nexus_mock_backend",
            "--host",
            host,
            "--port",
            "0",
            "--name",
            name,
            "--models",
            ",".join(models),
            *extra_args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    assert process.stdout is not None
    seen: list[str] = []
    for line in process.stdout:
        seen.append(line)
        match = READY_LINE.search(line)
        if match:
            return process, match.group(1)
    process.wait()
    raise RuntimeError(f"mock backend {name} did not start:\n{''.join(seen)}")


@transaction.atomic
def register_demo_backend(spec: DemoBackend, base_url: str) -> Backend:
    """Create or update the demo backend row to point at a running mock."""
    backend, _ = Backend.objects.update_or_create(
        name=spec.name,
        defaults={
            "base_url": base_url,
            "kind": BackendKind.OPENAI,
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
