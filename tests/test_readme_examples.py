"""The documentation's examples, run as a reader would run them.

Every fenced ``python`` and ``sh`` block of README.md and docs/*.md runs against
a real ``manage.py nexus_run`` in demo mode, as ``make run`` starts it, with the
gateway's address and the printed demo key put in for ``127.0.0.1:8000`` and
``nx-...``. A block must exit 0 and print what its ``# -> `` comments say
(``…`` matching anything). A block that cannot run here is marked in the page
with ``<!-- not-run: reason -->`` on the line before it.

Always the embedded default, whatever the suite's mode: that is what a reader
of the quick tour runs, so the production run would only repeat it. One
serving process: the examples do not depend on how many there are.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python": "python", "sh": "sh", "bash": "sh", "shell": "sh"}
PLACEHOLDER_URL = "127.0.0.1:8000"
PLACEHOLDER_KEY = "nx-..."
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(?P<reason>\S.*?)\s*-->")
EXPECT = re.compile(r"^\s*# -> (?P<text>.+)$", re.MULTILINE)
STARTUP_TIMEOUT = 90.0
EXAMPLE_TIMEOUT = 60.0

pytestmark = pytest.mark.mode_independent


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    language: str
    code: str
    not_run: str | None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def extract_examples(text: str, page: str) -> list[Example]:
    """The fenced blocks of a Markdown page in a language this test can run."""
    examples: list[Example] = []
    lines = text.split("\n")
    index = 0
    while index < len(lines):
        opening = re.fullmatch(r"```(\w*)\s*", lines[index])
        if not opening:
            index += 1
            continue
        end = index + 1
        while not lines[end].startswith("```"):
            end += 1
        language = RUNNABLE.get(opening.group(1))
        if language:
            before = next(
                (line for line in reversed(lines[:index]) if line.strip()), ""
            )
            marked = NOT_RUN.search(before)
            examples.append(
                Example(
                    page,
                    index + 1,
                    language,
                    "\n".join(lines[index + 1 : end]) + "\n",
                    marked.group("reason") if marked else None,
                )
            )
        index = end + 1
    return examples


def _all_examples() -> list[Example]:
    examples: list[Example] = []
    for path in PAGES:
        name = str(path.relative_to(REPO_ROOT))
        examples += extract_examples(path.read_text(encoding="utf-8"), name)
    return examples


EXAMPLES = _all_examples()
TO_RUN = [example for example in EXAMPLES if example.not_run is None]


def expected_output(code: str) -> list[re.Pattern[str]]:
    """What the block's ``# -> `` comments say it prints; ``…`` is anything."""
    return [
        re.compile(".*?".join(re.escape(part) for part in match["text"].split("…")))
        for match in EXPECT.finditer(code)
    ]


@dataclass
class Gateway:
    url: str
    key: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _embedded_env(state_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in (
        "DATABASE_URL",
        "REDIS_URL",
        "SECRET_KEY",
        "ALLOWED_HOSTS",
        "NEXUS_DEMO",
        "NEXUS_ADMIN_PASSWORD",
    ):
        env.pop(name, None)
    env["NEXUS_STATE_DIR"] = str(state_dir)
    return env


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """``make run`` on a fresh state directory: the demo and its key."""
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "nexus_run",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=REPO_ROOT,
        env=_embedded_env(tmp_path_factory.mktemp("readme") / "state"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    key = ""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    try:
        while "Press Ctrl-C to stop" not in "".join(seen[-3:]):
            assert time.monotonic() < deadline and process.poll() is None, (
                "nexus_run did not start:\n" + "".join(seen)
            )
            try:
                seen.append(lines.get(timeout=0.5))
            except queue.Empty:
                continue
            if found := re.search(r"Demo API key:\s+(nx-\S+)", seen[-1]):
                key = found.group(1)
        assert key, "no demo key printed:\n" + "".join(seen)
        yield Gateway(f"http://127.0.0.1:{port}", key)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _run(example: Example, gateway: Gateway) -> subprocess.CompletedProcess[str]:
    code = example.code.replace(f"http://{PLACEHOLDER_URL}", gateway.url)
    code = code.replace(PLACEHOLDER_KEY, gateway.key)
    if example.language == "python":
        command = [sys.executable, "-c", code]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", code]
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.lower().endswith("_proxy")
    }
    return subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT,
    )


@pytest.mark.parametrize("example", TO_RUN, ids=str)
def test_the_example_runs_and_prints_what_it_says(
    example: Example, gateway: Gateway
) -> None:
    # It must reach the gateway under test, never whatever listens on 8000.
    assert f"http://{PLACEHOLDER_URL}" in example.code, (
        f"{example}: an example must use http://{PLACEHOLDER_URL}, or be marked "
        "<!-- not-run: reason -->"
    )
    result = _run(example, gateway)
    assert result.returncode == 0, (
        f"{example} failed:\n{result.stdout}\n{result.stderr}"
    )
    assert result.stdout.strip(), f"{example} printed nothing"
    for pattern in expected_output(example.code):
        assert pattern.search(result.stdout), (
            f"{example}: expected {pattern.pattern!r} in its output:\n{result.stdout}"
        )


def test_the_readme_tour_is_run_and_every_skip_says_why() -> None:
    readme = [example for example in TO_RUN if example.page == "README.md"]
    # openai (chat, stream, tools), anthropic, ollama, curl.
    assert len(readme) >= 6, [str(example) for example in readme]
    assert len(TO_RUN) >= 9, [str(example) for example in TO_RUN]
    for example in EXAMPLES:
        assert example.not_run is None or len(example.not_run) > 5, example


def test_not_run_markers_and_expectations_are_read() -> None:
    page = (
        "Intro.\n\n<!-- not-run: it starts a server -->\n```sh\nmake run\n```\n\n"
        '```python\nprint("[demo-beta/llama3:8b] echo: Hi")\n# -> […] echo: Hi\n```\n'
        "```toml\n[routing]\n```\n"
    )
    skipped, ran = extract_examples(page, "page.md")
    assert (skipped.line, skipped.not_run, skipped.code) == (
        4,
        "it starts a server",
        "make run\n",
    )
    assert (ran.language, ran.not_run) == ("python", None)
    (pattern,) = expected_output(ran.code)
    assert pattern.search("[demo-beta/llama3:8b] echo: Hi")
    assert not pattern.search("[demo-beta/llama3:8b] echo: Hello there")
