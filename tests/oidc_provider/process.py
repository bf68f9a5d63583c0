"""Start the test OpenID provider (django-oauth-toolkit) as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Provider:
    url: str
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log: Path
    clients: list[str] = field(default_factory=list)

    def register_client(self, redirect_uri: str) -> None:
        """Register Nexus as a client that may be sent back to redirect_uri."""
        _run_django(self.env, "register", redirect_uri)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)


def start_provider(directory: Path, port: int) -> Provider:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.oidc_provider.settings",
        "OIDC_PROVIDER_DB": str(directory / "provider.sqlite3"),
        "OIDC_PROVIDER_KEY": pem,
        "PYTHONPATH": str(REPO),
    }
    env.pop("DATABASE_URL", None)
    _run_django(env, "setup")
    log = directory / "provider.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "django",
            "runserver",
            f"127.0.0.1:{port}",
            "--noreload",
            "--nothreading",
        ],
        env=env,
        cwd=REPO,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            answer = httpx.get(f"{url}/o/.well-known/openid-configuration", timeout=1)
        except httpx.HTTPError:
            return process.poll() is not None
        return answer.status_code == 200

    wait_until(ready, timeout=30)
    if process.poll() is not None:
        raise RuntimeError("the OpenID provider did not start:\n" + log.read_text())
    return Provider(url, env, process, log)


def _run_django(env: dict[str, str], *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "tests.oidc_provider.setup", *args],
        env=env,
        cwd=REPO,
        check=True,
        capture_output=True,
    )
