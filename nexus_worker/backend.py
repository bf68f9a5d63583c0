"""The worker's local model server: list its models, forward one request to it.

The only HTTP the worker makes besides its WebSocket goes through here, to the
``--backend`` base URL and nowhere else (no redirects followed).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import aiohttp

from nexus_worker.protocol import (
    MAX_EXPIRES_IN,
    MAX_LOADED_MODELS,
    MAX_MEMORY_BYTES,
    MAX_MODEL_NAME,
    BackendState,
    LoadedModel,
    Request,
)

logger = logging.getLogger("nexus.worker")

KINDS = ("auto", "ollama", "openai")
# What a model list may be (bytes, entries): a local backend is trusted, bounded.
MAX_LISTING_BYTES = 4 * 1024 * 1024
MAX_MODELS = 2000
# The request headers the gateway may pass on, and the response headers sent back.
# (traceparent and tracestate: the gateway's trace continues at the backend.)
FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "traceparent", "tracestate")
FORWARDED_RESPONSE_HEADERS = ("content-type", "retry-after")


class BackendError(Exception):
    """The local backend refused, timed out or answered something unreadable."""


class LocalBackend:
    """One local model server (Ollama or OpenAI-compatible) at a base URL."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        kind: str = "auto",
        api_key: str | None = None,
        read_timeout: float = 300.0,
    ) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.kind = kind
        self.api_key = api_key
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=10.0, sock_read=read_timeout
        )

    async def list_models(self) -> list[str]:
        """Return the backend's model names; with kind auto, learn the kind first.

        Raises BackendError if the backend cannot be reached or its answer has no
        model list.
        """
        if self.kind == "auto":
            for kind in ("ollama", "openai"):
                try:
                    models = await self._list(kind)
                except BackendError as exc:
                    logger.debug("backend is not %s: %s", kind, exc)
                    continue
                self.kind = kind
                logger.info("local backend %s speaks %s", self.base_url, kind)
                return models
            raise BackendError(
                f"{self.base_url} answers neither /api/tags (Ollama) nor /v1/models"
            )
        return await self._list(self.kind)

    async def _list(self, kind: str) -> list[str]:
        path = "/api/tags" if kind == "ollama" else "/v1/models"
        data = await self._get_json(path)
        entries = data.get("models" if kind == "ollama" else "data")
        if not isinstance(entries, list):
            raise BackendError(f"{path} has no model list")
        key = "name" if kind == "ollama" else "id"
        names = [
            entry[key]
            for entry in entries
            if isinstance(entry, dict) and isinstance(entry.get(key), str)
        ]
        if len(names) > MAX_MODELS:
            logger.warning(
                "the backend lists %d models; keeping %d", len(names), MAX_MODELS
            )
        long = [name for name in names if len(name) > MAX_MODEL_NAME]
        if long:
            logger.warning(
                "%d model names are longer than %d characters; not announced: %s",
                len(long),
                MAX_MODEL_NAME,
                ", ".join(repr(name[:60] + "...") for name in long[:5]),
            )
        return [name for name in names if 0 < len(name) <= MAX_MODEL_NAME][:MAX_MODELS]

    async def read_state(
        self, models: list[str], memory_bytes: int | None = None
    ) -> BackendState:
        """What the backend says of itself now, read as the gateway's health
        round reads a direct backend: Ollama's loaded models from /api/ps,
        llama.cpp's slots from /slots (it runs every model it lists). What
        cannot be read is None (unknown); `memory_bytes` is passed through.
        """
        loaded: tuple[LoadedModel, ...] | None = None
        slots = busy = None
        try:
            if self.kind == "ollama":
                loaded = _ollama_loaded(await self._get_json("/api/ps"))
            elif self.kind == "openai":
                slots, busy = _llamacpp_slots(await self._get_json_any("/slots"))
                if slots is not None:
                    loaded = tuple(LoadedModel(name) for name in models)
        except BackendError as exc:
            logger.debug("cannot read the local backend's state: %s", exc)
        return BackendState(
            loaded=None if loaded is None else loaded[:MAX_LOADED_MODELS],
            memory_bytes=memory_bytes,
            slots=slots,
            busy_slots=busy,
        )

    async def _get_json(self, path: str) -> dict[str, Any]:
        data = await self._get_json_any(path)
        if not isinstance(data, dict):
            raise BackendError(f"GET {path} is not a JSON object")
        return data

    async def _get_json_any(self, path: str) -> Any:
        try:
            async with self.session.get(
                self.base_url + path,
                headers=self._auth_headers(),
                timeout=aiohttp.ClientTimeout(total=10.0),
                allow_redirects=False,
            ) as response:
                if response.status != 200:
                    raise BackendError(f"GET {path} answered {response.status}")
                raw = await response.content.read(MAX_LISTING_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendError(f"GET {path} failed: {exc!r}") from None
        if len(raw) > MAX_LISTING_BYTES:
            raise BackendError(f"GET {path} is over {MAX_LISTING_BYTES} bytes")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise BackendError(f"GET {path} is not JSON") from None

    async def post(self, request: Request) -> aiohttp.ClientResponse:
        """Send the gateway's request to the backend; return the response head.

        The caller reads (or abandons) the body and must close the response.
        Raises BackendError if the backend refuses or times out.
        """
        headers = {
            name: value
            for name, value in request.headers.items()
            if name.lower() in FORWARDED_REQUEST_HEADERS
        }
        headers.update(self._auth_headers())
        try:
            return await self.session.request(
                request.method,
                self.base_url + request.endpoint,
                data=request.body.encode(),
                headers=headers,
                timeout=self.timeout,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendError(f"{self.base_url} did not answer: {exc!r}") from None

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def response_headers(response: aiohttp.ClientResponse) -> dict[str, str]:
    """Return the backend response headers worth passing back to the gateway."""
    return {
        name: response.headers[name]
        for name in FORWARDED_RESPONSE_HEADERS
        if name in response.headers
    }


async def iter_body(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Yield the body's bytes as they arrive; raise BackendError if the read fails."""
    try:
        async for data in response.content.iter_any():
            yield data
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BackendError(f"the backend's response broke off: {exc!r}") from None


def _ollama_loaded(payload: dict[str, Any]) -> tuple[LoadedModel, ...]:
    """/api/ps's models: name, size_vram, context_length, expires_at."""
    entries = payload.get("models")
    if not isinstance(entries, list):
        raise BackendError("GET /api/ps has no model list")
    now = time.time()
    loaded: dict[str, LoadedModel] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        name = entry.get("name") or entry.get("model")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_MODEL_NAME:
            continue
        loaded.setdefault(
            name,
            LoadedModel(
                name=name,
                vram_bytes=_bounded(entry.get("size_vram"), MAX_MEMORY_BYTES),
                context_length=_bounded(entry.get("context_length"), 2**31 - 1),
                expires_in=_seconds_until(entry.get("expires_at"), now),
            ),
        )
    return tuple(loaded.values())


def _llamacpp_slots(payload: Any) -> tuple[int | None, int | None]:
    """(slots, busy slots) from llama.cpp's /slots; (None, None) otherwise."""
    if not isinstance(payload, list) or not payload:
        return None, None
    slots = [slot for slot in payload if isinstance(slot, dict)]
    busy = sum(1 for slot in slots if slot.get("is_processing") is True)
    return min(len(slots), 10_000), min(busy, 10_000)


def _bounded(value: Any, most: int) -> int | None:
    """A positive integer up to `most`, else None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 < value <= most else None


def _seconds_until(value: Any, now: float) -> float | None:
    """Seconds from `now` to an RFC 3339 time (Ollama writes nanoseconds);
    None when unreadable, or beyond MAX_EXPIRES_IN (keep_alive -1: never)."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    head, dot, tail = value.partition(".")
    if dot:  # Python reads up to microseconds: drop the further digits
        digits = len(tail) - len(tail.lstrip("0123456789"))
        value = f"{head}.{tail[: min(digits, 6)]}{tail[digits:]}"
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None or moment.year < 2000:  # Ollama's zero time
        return None
    left = moment.timestamp() - now
    return max(left, 0.0) if left <= MAX_EXPIRES_IN else None
