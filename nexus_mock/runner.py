"""Run the mock backend as a process: event loop, signals and start-up line."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Callable

from nexus_mock.config import MockConfig
from nexus_mock.server import MockBackend


def run_mock_backend(
    config: MockConfig,
    *,
    host: str,
    port: int,
    refuse_ms: float | None = None,
    announce: Callable[[str], None],
) -> None:
    """Serve until SIGTERM or SIGINT. ``refuse_ms`` 0 refuses until SIGUSR1.

    Raises ListenError when the address cannot be bound.
    """
    with asyncio.Runner(loop_factory=_find_loop_factory()) as runner:
        runner.run(_serve(config, host, port, refuse_ms, announce))


async def _serve(
    config: MockConfig,
    host: str,
    port: int,
    refuse_ms: float | None,
    announce: Callable[[str], None],
) -> None:
    loop = asyncio.get_running_loop()
    backend = MockBackend(config)
    url = await backend.start(host, port, refuse_ms)
    stopping = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    if hasattr(signal, "SIGUSR1"):
        loop.add_signal_handler(signal.SIGUSR1, backend.listen_again)
    models = ", ".join(config.models)
    note = ""
    if refuse_ms == 0:
        note = " (refusing connections until SIGUSR1)"
    elif refuse_ms is not None:
        note = f" (refusing connections for the first {refuse_ms:g} ms)"
    announce(f"Mock backend {config.name!r} listening on {url}{note} models: {models}")
    # Start-up objects live for the whole run; keep the collector off them.
    gc.freeze()
    await stopping.wait()
    backend.stop()
    # One turn of the loop lets the aborted connections finish closing.
    await asyncio.sleep(0)
    # The reader of our output may already be gone.
    with contextlib.suppress(OSError):
        announce(f"Mock backend {config.name!r} stopped.")


def _find_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency everywhere but Windows
        return None
    return uvloop.new_event_loop
