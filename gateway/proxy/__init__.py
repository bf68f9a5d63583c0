"""The gateway's client API (OpenAI, Anthropic, Ollama): the hot path."""

from __future__ import annotations

from gateway.proxy.dispatch import ProxyApp
from gateway.proxy.surfaces import OLLAMA_PATHS

__all__ = ["OLLAMA_PATHS", "ProxyApp"]
