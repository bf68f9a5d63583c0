"""What an Ollama node keeps in memory: the mock's loaded models (fleet tests).

Active for ``--kind ollama`` once any of ``model_sizes`` (``--model
NAME:SIZE_GB``), ``memory_gb`` or ``load_seconds`` is set; otherwise the
mock's ``/api/ps`` lists ``loaded_models`` as before and nothing loads.

A request for a model that is not loaded waits ``load_seconds`` (one load
however many requests wait for it) and counts one load. A model that does not
fit under ``memory_gb`` evicts the least recently used idle models first, as
Ollama does (when none is idle it loads anyway: the mock does not queue for
memory), unless ``oom_loads`` is set: then the load fails with Ollama's own
500, "model requires more system memory (X GiB) than is available (Y GiB)"
(``"estimate"``) or "llama runner process has terminated: CUDA error: out of
memory" (``"runner"``). A
loaded model stays ``keep_alive`` seconds after its last request ended (the
request's own ``keep_alive``: seconds or "5m"/"30s"/"1h", 0 unloads at once,
negative keeps it forever; else ``keep_alive_seconds``).

``resident`` models (``resident_models``, GB each) are what other clients keep
loaded there: ``/api/ps`` lists them and they take memory, but no request of
ours uses them and they are never unloaded.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from nexus_mock.jobs import ApiError
from nexus_mock.replies import encode_json

GB = 1_000_000_000
GIB = 1_073_741_824
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(slots=True)
class LoadedModel:
    """One model in the node's memory."""

    size_gb: float
    last_used: float
    expires_at: float  # time.time(); inf: never
    in_use: int = 0
    keep_alive: float = 300.0


class LoadRefused(Exception):
    """A model that does not fit in the node's memory (``oom_loads``)."""

    def as_error(self, *, native: bool) -> ApiError:
        """Ollama's 500: ``{"error": ...}`` natively, OpenAI's shape on /v1."""
        message = str(self)
        if native:
            return ApiError(500, message, body=encode_json({"error": message}))
        return ApiError(500, message, error_type="api_error")


@dataclass
class NodeMemory:
    """The loaded models of one mock Ollama node, and the loads it performed."""

    sizes: dict[str, float]
    ceiling_gb: float | None
    load_seconds: float
    keep_alive_seconds: float
    loaded: dict[str, LoadedModel] = field(default_factory=dict)
    loads: Counter[str] = field(default_factory=Counter)
    # Loads that an inference request waited for (the rest: load-only requests,
    # such as a gateway's warm-ups).
    cold_starts: int = 0
    evictions: int = 0
    resident: dict[str, float] = field(default_factory=dict)
    oom_loads: str | None = None
    refused: int = 0
    _loading: dict[str, asyncio.Future[None]] = field(default_factory=dict)

    def preload(self, models: tuple[str, ...]) -> None:
        """Start with `models` loaded (as many as fit), without counting loads."""
        for model in models:
            if self._fits(self.size_of(model)):
                self._install(model, self.keep_alive_seconds)

    def size_of(self, model: str) -> float:
        """The model's size in GB (4.7 when not given, a 4-bit 8B model)."""
        return self.sizes.get(model, 4.7)

    @property
    def used_gb(self) -> float:
        """Memory the loaded models take (resident ones too)."""
        return sum(entry.size_gb for entry in self.loaded.values()) + sum(
            self.resident.values()
        )

    def is_loaded(self, model: str) -> bool:
        """Whether `model` is in memory now (expired models are dropped first)."""
        self.expire()
        return model in self.loaded

    async def acquire(
        self, model: str, keep_alive: float | None, *, load_only: bool = False
    ) -> bool:
        """Have `model` loaded and in use by one more request; True if it was cold.

        Pair with ``release``. Requests arriving during a load wait for it; an
        inference request (not `load_only`) that waited counts a cold start.
        """
        waited = False
        self.expire()
        alive = self.keep_alive_seconds if keep_alive is None else keep_alive
        cold = False
        while model not in self.loaded:
            pending = self._loading.get(model)
            waited = True
            if pending is not None:
                await asyncio.shield(pending)
                continue
            cold = True
            await self._load(model, alive)
        if waited and not load_only:
            self.cold_starts += 1
        entry = self.loaded[model]
        entry.in_use += 1
        entry.keep_alive = alive
        entry.last_used = time.monotonic()
        entry.expires_at = math.inf
        return cold

    def release(self, model: str) -> None:
        """One request for `model` ended: start its keep-alive clock."""
        entry = self.loaded.get(model)
        if entry is None:
            return
        entry.in_use = max(entry.in_use - 1, 0)
        entry.last_used = time.monotonic()
        if entry.in_use == 0:
            alive = entry.keep_alive
            if alive == 0:
                del self.loaded[model]
                return
            entry.expires_at = math.inf if alive < 0 else time.time() + alive

    def expire(self) -> None:
        """Unload idle models whose keep-alive ran out."""
        now = time.time()
        for model in [
            name
            for name, entry in self.loaded.items()
            if entry.in_use == 0 and entry.expires_at <= now
        ]:
            del self.loaded[model]

    async def _load(self, model: str, keep_alive: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._loading[model] = future
        try:
            self._make_room(self.size_of(model))
            if self.load_seconds > 0:
                await asyncio.sleep(self.load_seconds)
            self._install(model, keep_alive)
            self.loads[model] += 1
        finally:
            del self._loading[model]
            future.set_result(None)

    def _install(self, model: str, keep_alive: float) -> None:
        expires = math.inf if keep_alive < 0 else time.time() + keep_alive
        self.loaded[model] = LoadedModel(
            self.size_of(model), time.monotonic(), expires, keep_alive=keep_alive
        )

    def _fits(self, size_gb: float) -> bool:
        return self.ceiling_gb is None or self.used_gb + size_gb <= self.ceiling_gb

    def _make_room(self, size_gb: float) -> None:
        idle = sorted(
            (entry.last_used, name)
            for name, entry in self.loaded.items()
            if entry.in_use == 0
        )
        for _, name in idle:
            if self._fits(size_gb):
                return
            del self.loaded[name]
            self.evictions += 1
        if self.oom_loads is not None and not self._fits(size_gb):
            self.refused += 1
            if self.oom_loads == "runner":
                raise LoadRefused(
                    "llama runner process has terminated: CUDA error: out of memory"
                )
            available = max((self.ceiling_gb or 0.0) - self.used_gb, 0.0)
            raise LoadRefused(
                f"model requires more system memory ({size_gb * GB / GIB:.1f} "
                f"GiB) than is available ({available * GB / GIB:.1f} GiB)"
            )

    def ps(self, context_length: int) -> list[dict[str, Any]]:
        """Ollama's /api/ps entries (without the tag fields)."""
        self.expire()
        sizes = {name: entry.size_gb for name, entry in self.loaded.items()}
        expiries = {name: entry.expires_at for name, entry in self.loaded.items()}
        return [
            {
                "name": name,
                "size": int(size_gb * GB),
                "size_vram": int(size_gb * GB),
                "expires_at": _iso(expiries.get(name, math.inf)),
                "context_length": context_length,
            }
            for name, size_gb in sorted({**self.resident, **sizes}.items())
        ]

    def as_dict(self) -> dict[str, Any]:
        """The counters /_mock/stats shows."""
        self.expire()
        return {
            "loads_total": sum(self.loads.values()),
            "loads": dict(self.loads),
            "cold_starts": self.cold_starts,
            "evictions_total": self.evictions,
            "loads_refused": self.refused,
            "loaded_models": sorted(self.loaded),
            "memory_used_gb": round(self.used_gb, 3),
        }


def parse_keep_alive(value: Any) -> float | None:
    """Seconds from a request's keep_alive (None: absent or unreadable)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip().lower()
    for unit in ("ms", "s", "m", "h"):
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * _UNITS[unit]
            except ValueError:
                return None
    try:
        return float(text)
    except ValueError:
        return None


def _iso(epoch: float) -> str:
    if math.isinf(epoch):
        epoch = 2**31 - 1  # "forever", as a date Ollama-like clients can parse
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
