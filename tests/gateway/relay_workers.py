"""`nexus-worker` as a child process, for the relay's end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from tests import zygote
from tests.conftest import REPO_ROOT, MockBackendProcess, NexusServer


@dataclass
class WorkerProcess:
    """``python -m nexus_worker`` as a child process, its output kept."""

    process: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.log)

    def stop(self) -> None:
        """Stop it the way an operator would (SIGTERM: drain, exit 0)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
                return
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """Stop it at once, whatever it was doing."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def start_worker(
    server: NexusServer, backend: MockBackendProcess, secret: str, *args: str
) -> WorkerProcess:
    """Run a worker for `server` in front of `backend`, with the secret in its
    environment (as an operator would set it) and `args` added."""
    process = zygote.Popen(
        [
            sys.executable,
            "-m",
            "nexus_worker",
            "--server",
            server.base_url,
            "--backend",
            backend.base_url,
            *args,
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "NEXUS_WORKER_SECRET": secret},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    worker = WorkerProcess(process)

    def collect() -> None:
        assert process.stdout is not None
        worker.log.extend(process.stdout)  # one line at a time, until it exits

    threading.Thread(target=collect, daemon=True).start()
    return worker
