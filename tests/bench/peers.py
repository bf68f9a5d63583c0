"""Peer gateways measured beside Nexus on the same mock: LiteLLM's proxy.

``make bench-peers`` installs LiteLLM in its own virtualenv (``.bench-peers/``,
never part of the product or the tests) and passes its ``litellm`` executable
with ``--litellm``. It runs as one uvicorn worker (``--num_workers 1``) with a
configuration that sends one model to the mock (OpenAI-compatible), with no
master key that the clients send (LiteLLM refuses to start without one, and
Nexus checks its own keys too) and no database.
"""

from __future__ import annotations

import json
from pathlib import Path

READY_PATH = "/health/liveliness"
MASTER_KEY = "sk-nexus-bench-litellm"
# Variables that would make LiteLLM use Nexus's database or cache, or reach
# for the internet at start-up.
_DROPPED = ("DATABASE_URL", "REDIS_URL", "REDIS_HOST", "DJANGO_SETTINGS_MODULE")
_SET = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOG": "ERROR",
    "LITELLM_TELEMETRY": "False",
    "NO_DOCKER": "True",
}


def write_litellm_config(directory: Path, mock_url: str, model: str) -> Path:
    """Write a LiteLLM proxy configuration that routes ``model`` to the mock."""
    # JSON is YAML: no YAML library is needed to write it.
    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    "model": f"openai/{model}",
                    "api_base": f"{mock_url}/v1",
                    "api_key": "not-checked-by-the-mock",
                },
            }
        ],
        "litellm_settings": {"drop_params": True, "telemetry": False},
        "general_settings": {"master_key": MASTER_KEY},
    }
    path = directory / "litellm-config.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def litellm_command(executable: str, config: Path) -> list[str]:
    """The start of LiteLLM's command line (the launcher adds host, port, workers)."""
    return [executable, "--config", str(config)]


def litellm_environment(env: dict[str, str]) -> dict[str, str]:
    """The benchmark's environment minus what would change LiteLLM's set-up."""
    child = {k: v for k, v in env.items() if k not in _DROPPED}
    child.update(_SET)
    return child
