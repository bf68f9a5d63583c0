"""nexus-worker on a GPU box: it imports nothing of Django, Celery or the gateway.

The worker ships on its own (``nexus_worker/pyproject.toml``: aiohttp is its
only dependency). These tests hold it to that: importing its command line loads
no Django, Celery, Channels, Redis or Nexus app module, and the package copied
alone next to aiohttp and what aiohttp needs, in an interpreter that cannot
import Django at all, registers with a real gateway and serves an openai client.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from backends.models import Worker
from tests.conftest import REPO_ROOT, NexusServer, start_mock_backend, wait_until
from usage.models import ApiKey

# Top-level modules a GPU box must not need.
FORBIDDEN = (
    "django",
    "celery",
    "kombu",
    "channels",
    "rest_framework",
    "redis",
    "psycopg",
    "nexus_site",
    "gateway",
    "routing",
    "usage",
    "backends",
    "nexus_lib",
    "nexus_mock",
)

_LIST_MODULES = """
import json, sys
import nexus_worker.cli, nexus_worker.daemon, nexus_worker.forwarding
files = {}
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if path and "." not in name:
        files[name] = path
print(json.dumps({"loaded": sorted({n.split(".")[0] for n in sys.modules}),
                  "files": files}))
"""


def _worker_imports() -> dict[str, object]:
    """What importing the worker loads, in a fresh interpreter without Django
    settings (as on a GPU box)."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", _LIST_MODULES],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


@pytest.mark.mode_independent
def test_importing_the_worker_loads_no_django_celery_or_nexus_app() -> None:
    loaded = set(_worker_imports()["loaded"])  # type: ignore[arg-type]
    assert "nexus_worker" in loaded and "aiohttp" in loaded
    assert loaded.isdisjoint(FORBIDDEN), sorted(loaded & set(FORBIDDEN))


def _standalone_install(root: Path) -> list[Path]:
    """The worker package and aiohttp's own dependencies, alone in `root`: what
    ``pip install ./nexus_worker`` puts on a bare machine. Returns sys.path."""
    package, site = root / "package", root / "site"
    shutil.copytree(
        REPO_ROOT / "nexus_worker",
        package / "nexus_worker",
        ignore=shutil.ignore_patterns("__pycache__", "pyproject.toml"),
    )
    site.mkdir()
    files: dict[str, str] = _worker_imports()["files"]  # type: ignore[assignment]
    stdlib = Path(os.__file__).parent
    for name, file in files.items():
        path = Path(file)
        if name == "nexus_worker" or path.is_relative_to(stdlib):
            continue
        source = path.parent if path.name == "__init__.py" else path
        (site / source.name).symlink_to(source)
    return [package, site]


_BOOT = """
import importlib.util, sys
sys.path[:0] = {paths!r}
if importlib.util.find_spec("django") is not None:
    sys.exit("django is importable here")
from nexus_worker.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.django_db(transaction=True)
def test_the_worker_alone_serves_a_gateway_without_django_on_its_path(
    tmp_path: Path, nexus_server_factory: Callable[..., NexusServer]
) -> None:
    paths = [str(p) for p in _standalone_install(tmp_path)]
    local = start_mock_backend("--models", "llama3:8b", "--name", "gpu-box")
    _, secret = Worker.objects.create_worker("gpu-standalone")
    _, key = ApiKey.objects.create_key("standalone-worker")
    server = nexus_server_factory(NEXUS_RELAY_HEARTBEAT_SECONDS="1")
    # -S: no site-packages (no Django, no Celery); -I: nothing from the
    # environment or the current directory either.
    worker = subprocess.Popen(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            _BOOT.format(paths=paths),
            "--server",
            server.base_url,
            "--backend",
            local.base_url,
            "--name",
            "gpu-standalone",
        ],
        cwd=tmp_path,
        env={"NEXUS_WORKER_SECRET": secret, "PATH": os.environ.get("PATH", "")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    threading.Thread(
        target=lambda: log.extend(worker.stdout or ()), daemon=True
    ).start()
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=20
    )

    def served() -> bool:
        assert worker.poll() is None, "".join(log)
        try:
            reply = client.chat.completions.create(
                model="llama3:8b", messages=[{"role": "user", "content": "hi"}]
            )
        except openai.APIError:
            return False
        return reply.model == "llama3:8b" and bool(reply.choices[0].message.content)

    try:
        wait_until(served, 30, "llama3:8b served by the standalone worker")
        worker.terminate()
        assert worker.wait(15) == 0, "".join(log)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
        local.stop()
