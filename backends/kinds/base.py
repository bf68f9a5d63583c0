"""What every kind adapter shares: the values they exchange and the base class."""

from __future__ import annotations

import enum
import errno
import json
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from backends.vocabulary import LoadedModel

_CONTEXT_KEYS = (
    "max_model_len",
    "context_length",
    "context_window",
    "max_context_length",
)
MAX_MESSAGE = 300
# A server version is stored cut to this many characters.
MAX_VERSION = 100
# Bytes read of a version answer at most: /api/version and /version are a few
# bytes; llama.cpp's /props carries the chat template too.
MAX_VERSION_ANSWER = 16 * 1024
MAX_PROPS_ANSWER = 512 * 1024


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What an adapter needs to reach one backend, copied from its Backend row."""

    name: str
    kind: str
    base_url: str
    api_key: str = field(default="", repr=False)

    @property
    def root(self) -> str:
        """The server's root URL; a base URL given with /v1 works too."""
        return self.base_url.rstrip("/").removesuffix("/v1")


class ProbeStatus(enum.StrEnum):
    """What a probe found."""

    UP = "up"
    DOWN = "down"
    # Alive but not ready (llama.cpp loading its model): neither a success nor
    # a failure for the health state machine.
    LOADING = "loading"


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """What a server says about its memory and parallelism (None: it did not say).

    ``used_bytes``: what its loaded models take, all of them (Ollama's /api/ps
    size_vram sum); ``total_bytes``: what they may fill; ``pressure``: it is
    short of memory (vLLM's KV cache nearly full); ``slots``: requests it runs
    at once (llama.cpp's total_slots).
    """

    used_bytes: int | None = None
    total_bytes: int | None = None
    pressure: bool = False
    slots: int | None = None


@dataclass(frozen=True, slots=True)
class PrefixCacheReport:
    """What a server says about its prompt (prefix) cache (None: it did not say).

    ``hits`` and ``queries``: prompt tokens found in the cache and looked up
    since the server started (vLLM's prefix_cache counters); ``cache_tokens``:
    tokens the cache holds (vLLM's GPU blocks x block size, llama.cpp's slots
    x context per slot).
    """

    hits: int | None = None
    queries: int | None = None
    cache_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The outcome of one probe of one backend.

    ``latency_ms`` is the round trip of the probe's first request (None when it
    got no answer). ``loaded_models`` is set by kinds that report which models
    are in memory (Ollama), so that every health round refreshes it, and
    ``loaded_details`` what they said about each of them. ``version`` is the
    server's version as the health round read it: "" for a kind that reports
    none, None when it was not read (the one recorded before stays).
    ``memory`` is what the server said of its memory (None: nothing, the one
    recorded before stays).
    """

    status: ProbeStatus
    latency_ms: float | None = None
    error: str = ""
    loaded_models: frozenset[str] | None = None
    loaded_details: Mapping[str, LoadedModel] | None = None
    version: str | None = None
    memory: MemoryReport | None = None
    # What it said of its prompt cache (None: nothing, the one recorded stays).
    prefix_cache: PrefixCacheReport | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model as a backend reports it; None means the backend did not say."""

    name: str
    context_length: int | None = None
    supports_vision: bool | None = None
    supports_tools: bool | None = None
    supports_json_mode: bool | None = None
    loaded: bool | None = None
    size_bytes: int | None = None
    parameters_b: float | None = None
    kv_bytes_per_token: int | None = None


class ProbeFailed(Exception):
    """The backend answered, but not as a healthy backend of its kind would.

    The message is short and safe to store and show.
    """


class BackendLoading(ProbeFailed):
    """The backend is up but still loading its model (llama.cpp's 503)."""


class BackendKindAdapter:
    """Probe and discover one kind of backend. Subclasses set ``kind``.

    ``probe()`` must be cheap: it runs for every backend every few seconds.
    ``list_models()`` may cost more (it runs every few minutes). Both raise
    ProbeFailed or an httpx.TransportError; ``describe_error()`` turns either
    into a short message.
    """

    kind: ClassVar[str]
    # False when models come from configuration (the adapter cannot list them).
    discovers_models: ClassVar[bool] = True
    # Reported for every listed model: JSON mode is a server feature here.
    server_json_mode: ClassVar[bool | None] = None
    # True when every listed model is in memory (a server runs what it lists).
    lists_loaded_models: ClassVar[bool] = False

    async def probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> ProbeResult:
        """Check that the backend answers as a healthy one of its kind."""
        _, latency = await self._get_json(client, endpoint, "/v1/models")
        return ProbeResult(ProbeStatus.UP, latency_ms=latency)

    async def read_version(self, client: httpx.AsyncClient, endpoint: Endpoint) -> str:
        """Return the server's version ("": this kind does not say).

        Asked by the health round after a good probe, never on a request.
        Raises like ``probe()``; the caller bounds its time.
        """
        return ""

    async def list_models(
        self, client: httpx.AsyncClient, endpoint: Endpoint
    ) -> list[ModelInfo]:
        """Return every model the backend serves now."""
        payload, _ = await self._get_json(client, endpoint, "/v1/models")
        return [
            ModelInfo(
                name=entry["id"],
                context_length=context_of_entry(entry),
                supports_json_mode=self.server_json_mode,
                loaded=True if self.lists_loaded_models else None,
            )
            for entry in model_entries(payload, "/v1/models")
        ]

    def headers(self, endpoint: Endpoint) -> dict[str, str]:
        """Authentication headers for this kind."""
        if endpoint.api_key:
            return {"authorization": f"Bearer {endpoint.api_key}"}
        return {}

    async def _request(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
    ) -> tuple[httpx.Response, float]:
        started = time.perf_counter()
        response = await client.request(
            method, endpoint.root + path, headers=self.headers(endpoint), json=body
        )
        return response, (time.perf_counter() - started) * 1000

    async def _get_json(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        path: str,
        *,
        method: str = "GET",
        body: Mapping[str, Any] | None = None,
    ) -> tuple[Any, float]:
        response, latency = await self._request(client, endpoint, method, path, body)
        self._check_status(response, method, path)
        try:
            return response.json(), latency
        except ValueError:
            raise ProbeFailed(f"{method} {path} did not answer JSON") from None

    async def _get_small_json(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        path: str,
        max_bytes: int,
    ) -> Any:
        """GET `path` and parse its JSON, reading at most `max_bytes` of it.

        Raises ProbeFailed for a longer answer (never read past the limit).
        """
        body = await self._get_small_body(client, endpoint, path, max_bytes)
        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            raise ProbeFailed(f"GET {path} did not answer JSON") from None

    async def _get_small_text(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        path: str,
        max_bytes: int,
    ) -> str:
        """GET `path` as text, reading at most `max_bytes` (else ProbeFailed)."""
        body = await self._get_small_body(client, endpoint, path, max_bytes)
        return body.decode("utf-8", "replace")

    async def _get_small_body(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        path: str,
        max_bytes: int,
    ) -> bytes:
        # Raw bytes, uncompressed: a few compressed bytes cannot expand past
        # the limit before it is checked.
        headers = {**self.headers(endpoint), "accept-encoding": "identity"}
        async with client.stream(
            "GET", endpoint.root + path, headers=headers
        ) as response:
            self._check_status(response, "GET", path)
            body = bytearray()
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > max_bytes:
                    raise ProbeFailed(f"GET {path} answered over {max_bytes} bytes")
        return bytes(body)

    def _check_status(self, response: httpx.Response, method: str, path: str) -> None:
        status = response.status_code
        if status < 300:
            return
        where = f"HTTP {status} from {method} {path}"
        if status in (401, 403):
            raise ProbeFailed(f"authentication failed ({where}); check the API key")
        if status == 404:
            raise ProbeFailed(
                f"{where}: is this a {self.kind} server, and is the base URL its root?"
            )
        if 300 <= status < 400:
            raise ProbeFailed(f"{where} (redirects are not followed; check the URL)")
        raise ProbeFailed(where)


def describe_error(error: BaseException, timeout: float | None = None) -> str:
    """Return a short, secret-free description of why a probe failed."""
    if isinstance(error, ProbeFailed):
        return str(error)[:MAX_MESSAGE]
    if isinstance(error, TimeoutError | httpx.TimeoutException):
        if isinstance(error, httpx.ConnectTimeout):
            return "connect timed out"
        if timeout is not None:
            return f"no answer within {timeout:g} s"
        return "timed out"
    if isinstance(error, httpx.ConnectError):
        return _describe_connect_error(error)
    if isinstance(error, httpx.RemoteProtocolError):
        return "the server closed the connection or broke HTTP"
    if isinstance(error, httpx.TransportError):
        return f"transport error ({type(error).__name__})"
    if isinstance(error, KeyError):
        return "the answer lacked an expected field"
    return f"unexpected error ({type(error).__name__})"


def _describe_connect_error(error: httpx.ConnectError) -> str:
    cause: BaseException | None = error
    seen = 0
    while cause is not None and seen < 10:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return "TLS certificate verification failed"
        if isinstance(cause, ssl.SSLError):
            return "TLS handshake failed"
        if isinstance(cause, OSError) and cause.errno is not None:
            if cause.errno == errno.ECONNREFUSED:
                return "connection refused"
            if cause.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                return "host unreachable"
            if cause.strerror:
                return f"cannot connect ({cause.strerror})"
        if type(cause).__name__ == "gaierror":
            return "host name not found"
        cause = cause.__cause__ or cause.__context__
        seen += 1
    text = str(error).lower()
    if "refused" in text or "all connection attempts failed" in text:
        return "connection refused"
    if "name or service not known" in text or "nodename nor servname" in text:
        return "host name not found"
    return "cannot connect"


def version_in(payload: Any, key: str, path: str) -> str:
    """The version string at `key` of a JSON object, cleaned for storing.

    Printable ASCII only (a version is shown in the admin and /health), cut to
    MAX_VERSION characters; "" when the object does not have it.
    """
    if not isinstance(payload, dict):
        raise ProbeFailed(f"GET {path} did not answer a JSON object")
    value = payload.get(key)
    if not isinstance(value, str):
        return ""
    text = "".join(c for c in value[: MAX_VERSION * 4] if " " <= c <= "~")
    return text.strip()[:MAX_VERSION]


def model_entries(payload: Any, path: str) -> list[dict[str, Any]]:
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ProbeFailed(f"GET {path} did not answer a model list")
    return [
        entry
        for entry in data
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry["id"]
    ]


def context_of_entry(entry: Mapping[str, Any]) -> int | None:
    for key in _CONTEXT_KEYS:
        value = positive_int(entry.get(key))
        if value is not None:
            return value
    return None


def positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not 1 <= value < 2**31:  # also rejects NaN
        return None
    return int(value)
