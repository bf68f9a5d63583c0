"""How far one request walks through the code: ``python -m tests.bench.walk``.

Not a test and not a speed measurement: it serves one chat request (stream or
not, optionally from an Anthropic client) through an in-process gateway in
front of the mock backend, with a profiler hook that records every Nexus
function the request calls (project frames only, not Django's or aiohttp's),
and prints how many distinct functions, files and packages that is, the
deepest chain of Nexus calls, and the files in the order first entered. Used
to compare layouts (issue 26: the model-name walk before and after).

Runs in the embedded default, in a scratch state directory of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "routing", "usage", "backends", "nexus_lib", "nexus_site")


def _setup_django(state: Path) -> None:
    for name in ("DATABASE_URL", "REDIS_URL"):
        os.environ.pop(name, None)
    os.environ["NEXUS_STATE_DIR"] = str(state)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nexus_site.settings")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def _gateway_classes() -> tuple[Any, Any, Any]:
    try:
        from gateway.process import Gateway, GatewayConfig
        from gateway.proxy import ProxyApp
    except ImportError:  # the layout before issue 26
        from routing.gateway import Gateway, GatewayConfig  # type: ignore
        from routing.proxy import ProxyApp  # type: ignore
    return Gateway, GatewayConfig, ProxyApp


class Walk:
    """Records the Nexus functions called while it is on."""

    def __init__(self) -> None:
        self.functions: dict[tuple[str, str], int] = {}
        self.files: list[str] = []
        self.depth = self.deepest = 0

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        path = frame.f_code.co_filename
        if not path.startswith(str(REPO)) or "/tests/" in path:
            return
        relative = str(Path(path).relative_to(REPO))
        if relative.split("/")[0] not in PACKAGES:
            return
        if event == "call":
            key = (relative, frame.f_code.co_qualname)
            self.functions[key] = self.functions.get(key, 0) + 1
            if relative not in self.files:
                self.files.append(relative)
            self.depth += 1
            self.deepest = max(self.deepest, self.depth)
        elif event == "return":
            self.depth -= 1


async def _serve(app: Any, path: str, body: dict[str, Any], headers: dict[str, str]):
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://nexus") as c:
        return await c.post(path, json=body, headers=headers)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.walk")
    parser.add_argument("--stream", action="store_true", help="A streamed request.")
    parser.add_argument(
        "--anthropic", action="store_true", help="An Anthropic client's request."
    )
    options = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as state:
        _setup_django(Path(state))
        from backends.models import Backend, BackendModel, HealthStatus
        from nexus_mock import spawn_mock_backend
        from usage.models import ApiKey

        mock = spawn_mock_backend("--models", "llama3:8b", cwd=REPO)
        try:
            backend = Backend.objects.create(
                name="mock", base_url=mock.base_url, status=HealthStatus.HEALTHY
            )
            BackendModel.objects.create(backend=backend, name="llama3:8b")
            _, key = ApiKey.objects.create_key("walk")
            gateway_class, config_class, app_class = _gateway_classes()
            gateway = gateway_class(config_class(usage_transport="database"))
            gateway.snapshots.load()
            app = app_class(gateway)
            messages = [{"role": "user", "content": "walk"}]
            if options.anthropic:
                path = "/v1/messages"
                body: dict[str, Any] = {"max_tokens": 16, "messages": messages}
                headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
            else:
                path, body = "/v1/chat/completions", {"messages": messages}
                headers = {"authorization": f"Bearer {key}"}
            body.update(model="llama3:8b", stream=options.stream)
            # One request first: what runs once per process (start-up) is not
            # the request's walk.
            loop = asyncio.new_event_loop()
            loop.run_until_complete(_serve(app, path, body, headers))
            walk = Walk()
            sys.setprofile(walk.hook)
            try:
                reply = loop.run_until_complete(_serve(app, path, body, headers))
            finally:
                sys.setprofile(None)
            loop.run_until_complete(gateway.stop())
            loop.close()
        finally:
            mock.stop()
    packages = {"/".join(f.split("/")[:-1]) or f for f in walk.files}
    lines = [
        (
            f"status {reply.status_code}: {len(walk.functions)} Nexus functions in "
            f"{len(walk.files)} files and {len(packages)} packages; deepest chain of "
            f"Nexus calls {walk.deepest}. Files in the order first entered:"
        ),
    ]
    for name in walk.files:
        calls = sum(n for (f, _), n in walk.functions.items() if f == name)
        lines.append(f"  {name} ({calls} calls)")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
