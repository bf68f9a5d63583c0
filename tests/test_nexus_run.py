"""`manage.py nexus_run`: the README's run command, end to end, as real processes."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import openai
import pytest

from tests import zygote
from tests.conftest import spare_redis_url, wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent

# Each test starts the whole launcher (migrations, serving and worker processes,
# demo mocks) up to three times: on a 2-core machine shared with the rest of
# the suite one took 31 s here and outlasted 120 s in CI, where pytest-timeout
# then hid the output `expect` would have shown after its own 90 s.
pytestmark = pytest.mark.timeout(300)
STARTUP_TIMEOUT = 90.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@dataclass
class RunningNexus:
    process: subprocess.Popen[str]
    port: int
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    def expect(self, pattern: str, timeout: float = STARTUP_TIMEOUT) -> re.Match[str]:
        """Wait for an output line matching pattern; return the match."""
        regex = re.compile(pattern)
        for line in self.seen:
            if match := regex.search(line):
                return match
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    break
                continue
            self.seen.append(line)
            if match := regex.search(line):
                return match
        raise AssertionError(
            f"no line matching {pattern!r}; output was:\n" + "".join(self.seen)
        )

    def output(self) -> str:
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return "".join(self.seen)

    def interrupt(self) -> int:
        """Press Ctrl-C: SIGINT to the launcher's process group."""
        os.killpg(self.process.pid, signal.SIGINT)
        return self.process.wait(timeout=60)


@pytest.fixture
def run_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for a Nexus of its own: a fresh state dir and database."""
    env = dict(os.environ)
    env["NEXUS_STATE_DIR"] = str(tmp_path / "state")
    env.pop("NEXUS_ADMIN_PASSWORD", None)
    env.pop("NEXUS_DEMO", None)
    if os.environ.get("NEXUS_TEST_MODE") != "production":
        for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS"):
            env.pop(name, None)
        yield env
        return
    import psycopg

    url = urlsplit(os.environ["DATABASE_URL"])
    dbname = f"nexus_run_{uuid.uuid4().hex[:10]}"
    admin_dsn = urlunsplit(url._replace(path="/postgres"))
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    env["DATABASE_URL"] = urlunsplit(url._replace(path=f"/{dbname}"))
    env["REDIS_URL"] = spare_redis_url()
    try:
        yield env
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def _start(env: dict[str, str], *args: str) -> RunningNexus:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "manage.py", "nexus_run", "--port", str(port), *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    running = RunningNexus(process, port)

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            running.lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return running


@contextlib.contextmanager
def _login(base: str, username: str, password: str) -> Iterator[httpx.Client]:
    """Log in to the admin through its login form, as a browser would."""
    # A ceiling for a loaded CI machine, not an expectation.
    with httpx.Client(base_url=base, timeout=30) as client:
        _submit_login(client, base, username, password)
        yield client


def _submit_login(
    client: httpx.Client, base: str, username: str, password: str
) -> None:
    page = client.get("/admin/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token, page.text
    response = client.post(
        "/admin/login/?next=/admin/",
        data={
            "csrfmiddlewaretoken": token.group(1),
            "username": username,
            "password": password,
            "next": "/admin/",
        },
        headers={"Referer": f"{base}/admin/login/"},
    )
    assert response.status_code == 302, response.text
    assert response.headers["location"] == "/admin/"


def _demo_key_is_valid(env: dict[str, str], raw_key: str) -> bool:
    code = (
        "from usage.models import ApiKey; import sys; "
        f"sys.exit(0 if ApiKey.objects.for_raw_key({raw_key!r}) else 3)"
    )
    result = zygote.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
    )
    return result.returncode == 0


def test_run_command_brings_up_everything_and_ctrl_c_stops_it(
    run_env: dict[str, str],
) -> None:
    nexus = _start(run_env)
    try:
        password = nexus.expect(r"user 'admin' password (\S+) \(printed once").group(1)
        demo = [
            nexus.expect(rf"Demo backend {name} \(mock, pid (\d+)\) at (\S+)")
            for name in ("demo-alpha", "demo-beta")
        ]
        demo_urls = [m.group(2) for m in demo]
        demo_key = nexus.expect(r"Demo API key:\s+(nx-\S+)").group(1)
        pids = nexus.expect(r"web pid (\d+), worker pid (\d+), beat pid (\d+)")
        nexus.expect(r"\[worker\] .*nexus-worker@\S+ ready\.")
        nexus.expect(r"\[beat\] .*beat: Starting")

        base = f"http://127.0.0.1:{nexus.port}"
        with _login(base, "admin", password) as admin:
            listing = admin.get("/admin/backends/backend/")
            assert listing.status_code == 200
            assert "demo-alpha" in listing.text and "demo-beta" in listing.text
        for url in demo_urls:
            models = httpx.get(f"{url}/v1/models", timeout=5).json()
            assert {m["id"] for m in models["data"]} >= {"llama3:8b"}
        assert _demo_key_is_valid(run_env, demo_key)
        # The demo works as a gateway right away, through the official SDK.
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=demo_key, max_retries=0)
        reply = sdk.chat.completions.with_raw_response.create(
            model="llama3:8b", messages=[{"role": "user", "content": "hi demo"}]
        )
        assert reply.headers["x-nexus-backend"] in {"demo-alpha", "demo-beta"}
        assert reply.parse().choices[0].message.content.endswith("echo: hi demo")

        children = [int(pid) for pid in pids.groups()]
        children += [int(m.group(1)) for m in demo]
        assert nexus.interrupt() == 0
        output = nexus.output()
        assert "Stopped." in output
        for pid in children:
            assert not _is_alive(pid), f"pid {pid} survived Ctrl-C:\n{output}"
        for url in demo_urls:
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/v1/models", timeout=2)
    finally:
        if nexus.process.poll() is None:
            os.killpg(nexus.process.pid, signal.SIGKILL)

    # A second run keeps the admin password secret and the demo key stable.
    again = _start(run_env, "--workers", "1")  # what is kept, not the cores again
    try:
        again.expect(r"Press Ctrl-C to stop")
        assert again.expect(r"Demo API key:\s+(nx-\S+)").group(1) == demo_key
        assert password not in again.output()
        assert "password shown on first run" in again.output()
        assert again.interrupt() == 0
    finally:
        if again.process.poll() is None:
            os.killpg(again.process.pid, signal.SIGKILL)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
OWN_CONFIG = """
[routing.aliases]
"gpt-4" = "mistral:7b"

[[backends]]
name = "gpu-1"
url = "http://127.0.0.1:9"
kind = "openai"
[[backends.models]]
name = "llama3:70b"
"""


def _remove_demo_backends_in_admin(base: str, password: str) -> str:
    """Select every backend in the admin list and run "Remove demo backends"."""
    with _login(base, "admin", password) as admin:
        page = admin.get("/admin/backends/backend/")
        assert "Remove demo backends" in page.text
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        assert token, page.text
        done = admin.post(
            "/admin/backends/backend/",
            data={
                "csrfmiddlewaretoken": token.group(1),
                "action": "remove_demo_backends",
                "index": "0",
                "_selected_action": re.findall(
                    r'name="_selected_action" value="(\d+)"', page.text
                ),
            },
            headers={"Referer": f"{base}/admin/backends/backend/"},
            follow_redirects=True,
        )
        assert done.status_code == 200
        return done.text


def test_demo_tool_calls_and_demo_backends_kept_until_the_operator_removes_them(
    run_env: dict[str, str], tmp_path: Path
) -> None:
    password = "a-chosen-admin-password"
    run_env["NEXUS_ADMIN_PASSWORD"] = password
    nexus = _start(run_env, "--workers", "1")
    try:
        key = nexus.expect(r"Demo API key:\s+(nx-\S+)").group(1)
        nexus.expect(r"Press Ctrl-C to stop")
        assert "keep serving beside your own" not in nexus.output()
        sdk = openai.OpenAI(
            base_url=f"http://127.0.0.1:{nexus.port}/v1", api_key=key, max_retries=0
        )
        # Tool calling works out of the box: the demo mocks call the tool...
        ask = {"role": "user", "content": "Oslo"}
        first = sdk.chat.completions.create(
            model="llama3:8b", messages=[ask], tools=[WEATHER_TOOL]
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls is not None
        (call,) = choice.message.tool_calls
        assert call.type == "function"
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Oslo"}
        # ... streamed too, the arguments in pieces ...
        pieces = []
        for chunk in sdk.chat.completions.create(
            model="llama3:8b", messages=[ask], tools=[WEATHER_TOOL], stream=True
        ):
            for delta_call in chunk.choices[0].delta.tool_calls or ():
                assert delta_call.function is not None
                pieces.append(delta_call.function.arguments or "")
        assert json.loads("".join(pieces)) == {"city": "Oslo"}
        # ... and answer from the tool's result.
        second = sdk.chat.completions.create(
            model="llama3:8b",
            messages=[
                ask,
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"},
            ],
            tools=[WEATHER_TOOL],
        )
        assert second.choices[0].finish_reason == "stop"
        assert second.choices[0].message.content is not None
        assert second.choices[0].message.content.endswith("tool result: 12 C, rain")
        assert nexus.interrupt() == 0
    finally:
        if nexus.process.poll() is None:
            os.killpg(nexus.process.pid, signal.SIGKILL)

    # The operator adds a backend of their own, and an alias to a demo model.
    config = tmp_path / "nexus.toml"
    config.write_text(OWN_CONFIG)
    zygote.run(
        [sys.executable, "manage.py", "nexus_import_config", str(config)],
        cwd=REPO_ROOT,
        env=run_env,
        check=True,
        timeout=60,
    )

    # A restart keeps the demo backends, and says so and why.
    again = _start(run_env, "--workers", "1")
    try:
        again.expect(r"Demo backend demo-alpha \(mock")
        again.expect(
            r"Demo backends demo-alpha, demo-beta keep serving beside your own "
            r"\(gpu-1\) until you remove them: .*\"Remove demo backends\""
        )
        again.expect(r"Served only by the demo backends: alias gpt-4 -> mistral:7b")
        assert again.expect(r"Demo API key:\s+(nx-\S+)").group(1) == key
        again.expect(r"Press Ctrl-C to stop")
        base = f"http://127.0.0.1:{again.port}"
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        hello = [{"role": "user", "content": "hello"}]
        reply = sdk.chat.completions.with_raw_response.create(
            model="gpt-4", messages=hello
        )
        assert reply.headers["x-nexus-backend"] == "demo-alpha"

        page = _remove_demo_backends_in_admin(base, password)
        assert "Removed demo backends demo-alpha, demo-beta." in page
        assert (
            "No enabled backend serves llama3:8b, llava:7b, mistral:7b, "
            "nomic-embed-text now" in page
        )
        assert "Left alone (not demo backends): gpu-1." in page
        # Every serving process hears of it: the alias finds nothing now.
        deadline = time.monotonic() + 30
        while True:
            try:
                sdk.chat.completions.create(model="gpt-4", messages=hello)
            except openai.NotFoundError as error:
                assert "model_not_found" in str(error.body)
                break
            assert time.monotonic() < deadline, "gpt-4 still served"
            time.sleep(0.2)
        assert again.interrupt() == 0
    finally:
        if again.process.poll() is None:
            os.killpg(again.process.pid, signal.SIGKILL)

    # Removed for good: the next start has no demo and nothing to say about it.
    third = _start(run_env, "--workers", "1")
    try:
        third.expect(r"Press Ctrl-C to stop")
        output = third.output()
        assert "Demo backend" not in output and "Demo API key" not in output
        assert "Demo mode is off" not in output
        assert third.interrupt() == 0
    finally:
        if third.process.poll() is None:
            os.killpg(third.process.pid, signal.SIGKILL)


def test_demo_off_starts_no_mock_backends(run_env: dict[str, str]) -> None:
    run_env["NEXUS_DEMO"] = "0"
    run_env["NEXUS_ADMIN_PASSWORD"] = "a-chosen-admin-password"
    nexus = _start(run_env, "--workers", "1")
    try:
        nexus.expect(r"Press Ctrl-C to stop")
        output = nexus.output()
        assert "Demo backend" not in output and "Demo API key" not in output
        assert "password from NEXUS_ADMIN_PASSWORD" in output
        base = f"http://127.0.0.1:{nexus.port}"
        with _login(base, "admin", "a-chosen-admin-password") as admin:
            listing = admin.get("/admin/backends/backend/")
            assert listing.status_code == 200
            assert "demo-alpha" not in listing.text
        assert nexus.interrupt() == 0
    finally:
        if nexus.process.poll() is None:
            os.killpg(nexus.process.pid, signal.SIGKILL)


def _descendants(root: int) -> set[int]:
    """Every process below `root` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def test_a_killed_launcher_takes_its_children_with_it(
    run_env: dict[str, str],
) -> None:
    """kill -9 of nexus_run itself: its serving processes, worker, beat, demo
    mocks and private Redis used to live on (holding the port; the next start
    said "Another nexus_run serves from ..."). They now get SIGTERM and end."""
    run_env["NEXUS_ADMIN_PASSWORD"] = "a-chosen-admin-password"
    run_env["NEXUS_DRAIN_SECONDS"] = "1"
    nexus = _start(run_env, "--workers", "1")
    children: set[int] = set()
    try:
        nexus.expect(r"Press Ctrl-C to stop")
        children = _descendants(nexus.process.pid)
        said = nexus.output()
        assert "Demo backend" in said  # the mocks are among them
        assert len(children) >= 5, said  # web, worker, beat, 3 mocks (+ Redis)
        nexus.process.kill()
        nexus.process.wait()
        deadline = time.monotonic() + 30
        while (alive := _commands(pid for pid in children if _is_alive(pid))) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert not alive, "still running after the launcher died"
        assert _free_port_is(nexus.port)
    finally:
        # A failed test leaves nothing behind either.
        children |= _descendants(nexus.process.pid)
        with contextlib.suppress(ProcessLookupError):
            nexus.process.kill()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _commands(pids: Iterable[int]) -> list[str]:
    found = []
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            found.append(f"{pid}: {b' '.join(argv).decode(errors='replace')[:200]}")
    return found


def _free_port_is(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_busy_port_is_a_clear_error(run_env: dict[str, str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = zygote.run(
            [sys.executable, "manage.py", "nexus_run", "--port", str(port)],
            cwd=REPO_ROOT,
            env=run_env,
            timeout=60,
        )
    assert result.returncode != 0
    assert f"127.0.0.1:{port} is already in use" in result.stderr


def test_a_killed_serving_process_is_restarted_while_the_other_serves(
    run_env: dict[str, str],
) -> None:
    run_env["NEXUS_DEMO"] = "0"
    run_env["NEXUS_ADMIN_PASSWORD"] = "a-chosen-admin-password"
    nexus = _start(run_env, "--workers", "2")
    try:
        pids = nexus.expect(r"on one port \(pids (\d+), (\d+)\)")
        victim = int(pids.group(1))
        base = f"http://127.0.0.1:{nexus.port}"
        os.kill(victim, signal.SIGKILL)
        # The gateway keeps answering on the other process meanwhile.
        answered = [
            httpx.get(f"{base}/health/live", timeout=30).status_code for _ in range(20)
        ]
        assert answered == [200] * 20
        restarted = nexus.expect(r"web-1 restarted \(pid (\d+)\)", timeout=15)
        new_pid = int(restarted.group(1))
        assert new_pid != victim and _is_alive(new_pid)
        said = nexus.output()
        assert f"web-1 (pid {victim}) exited with -9; restarting it in 1 s." in said

        def counted() -> bool:
            metrics = httpx.get(f"{base}/metrics", timeout=30).text
            return 'nexus_process_restarts_total{process="web-1"} 1.0' in metrics

        wait_until(counted, 30, "the restart counted in /metrics")
        assert nexus.interrupt() == 0
    finally:
        if nexus.process.poll() is None:
            os.killpg(nexus.process.pid, signal.SIGKILL)
