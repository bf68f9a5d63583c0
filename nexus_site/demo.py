"""Demo mode: built-in mock backends that make a fresh install usable at once."""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from django.db import transaction
from django.utils import timezone

from backends.models import Backend, BackendKind, BackendModel, HealthStatus
from nexus_mock import MockBackendProcess, spawn_mock_backend
from nexus_site.launcher import die_with
from routing.models import Alias, ChainStep
from usage.models import ApiKey

DEMO_KEY_NAME = "demo"
# nomic-embed-text's size, so that code written against the demo fits the model.
DEMO_EMBEDDING_DIM = 768


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
            DemoModel("mistral:7b", 32768, tools=True, json_mode=True),
        ),
    ),
    DemoBackend(
        name="demo-beta",
        priority=2,
        models=(
            DemoModel("llama3:8b", 8192, tools=True, json_mode=True),
            DemoModel("llava:7b", 4096, vision=True, json_mode=True),
            # An embedding model, as Ollama serves it (768 numbers a vector).
            DemoModel("nomic-embed-text", 8192),
        ),
        kind=BackendKind.OLLAMA,
    ),
)


def spawn_demo_mock(spec: DemoBackend) -> MockBackendProcess:
    """Start the mock backend that plays ``spec``, slow enough to look real.

    A request that offers tools gets a scripted tool call (the mock's rule,
    ``nexus_mock.tools``), and one that asks for JSON (JSON mode, a schema,
    Ollama's ``format``) gets JSON that fits (``nexus_mock.structured``), so
    tool calling and structured output can be tried at once.
    Its stdout stays an open pipe for the launcher to relay.
    """
    capabilities: list[str] = []
    for flag, names in (
        ("--tool-models", [m.name for m in spec.models if m.tools]),
        ("--vision-models", [m.name for m in spec.models if m.vision]),
    ):
        if names:
            capabilities += [flag, ",".join(names)]
    return spawn_mock_backend(
        "--name",
        spec.name,
        "--kind",
        spec.kind,
        "--models",
        ",".join(model.name for model in spec.models),
        *capabilities,
        "--embedding-dim",
        str(DEMO_EMBEDDING_DIM),
        "--latency-ms",
        "20",
        "--chunk-delay-ms",
        "30",
        # The launcher, not the terminal's Ctrl-C, stops it; it dies with
        # the launcher if the launcher is killed.
        new_session=True,
        popen=functools.partial(subprocess.Popen, preexec_fn=die_with(os.getpid())),
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
            # A check time from an earlier run would be stale: no traffic.
            "status": HealthStatus.HEALTHY,
            "last_check_at": timezone.now(),
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


def disable_demo_backends() -> list[str]:
    """Stop routing to demo backends (their mock processes are not running).

    Returns the names of those newly disabled.
    """
    with transaction.atomic():
        demo = Backend.objects.filter(is_demo=True, enabled=True)
        names = sorted(demo.values_list("name", flat=True))
        if names:
            Backend.objects.filter(name__in=names).update(enabled=False)
            Backend.objects.announce_change()  # a bulk update sends no signals
    return names


def is_demo_wanted(explicit: bool | None) -> bool:
    """Whether nexus_run starts the demo backends.

    ``explicit`` (NEXUS_DEMO, --demo/--no-demo) decides when given. Otherwise
    demo mode is on for a fresh install, and stays on while demo backends are
    registered: adding backends of one's own does not take away the models
    one's aliases and chains may still name. The operator ends it by removing
    the demo backends (the admin action "Remove demo backends").
    """
    if explicit is not None:
        return explicit
    if Backend.objects.filter(is_demo=True).exists():
        return True
    return not Backend.objects.filter(is_demo=False).exists()


def own_backend_names() -> list[str]:
    """The operator's backends (every backend that is not a demo one)."""
    return list(
        Backend.objects.filter(is_demo=False)
        .order_by("priority", "name")
        .values_list("name", flat=True)
    )


def find_demo_dependents() -> list[str]:
    """Name the aliases and fallback steps whose model only demo backends serve.

    Each entry reads like ``alias gpt-4 -> llama3:8b`` or ``fallback chain of
    llama3:70b: step mistral:7b``, for a model that demo backends list and no
    enabled backend of the operator's serves.
    """
    own = set(
        BackendModel.objects.filter(
            enabled=True, backend__enabled=True, backend__is_demo=False
        ).values_list("name", flat=True)
    )
    demo_only = (
        set(
            BackendModel.objects.filter(backend__is_demo=True).values_list(
                "name", flat=True
            )
        )
        - own
    )
    if not demo_only:
        return []
    found = [
        f"alias {alias.name} -> {alias.target}"
        for alias in Alias.objects.filter(target__in=demo_only).order_by("name")
    ]
    steps = ChainStep.objects.filter(model__in=demo_only).select_related("chain")
    found += [
        f"fallback chain of {step.chain.model}: step {step.model}"
        for step in steps.order_by("chain__model", "position", "id")
    ]
    return found


def describe_kept_demo(own: list[str]) -> list[str]:
    """Start-up lines when the demo runs beside the operator's ``own`` backends."""
    if not own:
        return []
    names = ", ".join(spec.name for spec in DEMO_BACKENDS)
    lines = [
        (
            f"Demo backends {names} keep serving beside your own ({', '.join(own)}) "
            'until you remove them: admin, Backends, select them, action "Remove '
            'demo backends" (NEXUS_DEMO=0 stops them for a run).'
        )
    ]
    if dependents := find_demo_dependents():
        lines.append("  Served only by the demo backends: " + "; ".join(dependents))
    return lines


def describe_disabled_demo(disabled: list[str]) -> list[str]:
    """Start-up lines when demo mode is off and ``disabled`` were just disabled."""
    if not disabled:
        return []
    lines = [
        (
            f"Demo mode is off: demo backends {', '.join(disabled)} disabled "
            '(remove them with the admin action "Remove demo backends").'
        )
    ]
    if dependents := find_demo_dependents():
        lines.append(
            "  Now served by no backend (an alias to them answers 404): "
            + "; ".join(dependents)
        )
    return lines


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
