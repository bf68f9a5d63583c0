"""The gateway's client API (OpenAI, Anthropic, Ollama): the hot path."""

from __future__ import annotations

from gateway.proxy.dispatch import ProxyApp
from gateway.proxy.surfaces import OLLAMA_PATHS, is_ollama_blob

__all__ = ["OLLAMA_PATHS", "ProxyApp", "is_ollama_blob"]
