"""The OpenAI-compatible proxy: the hot path of every gateway request."""

from __future__ import annotations

from routing.proxy.app import ProxyApp

__all__ = ["ProxyApp"]
