"""Sending on the Channels layer from sync code without hanging a stopping process.

Sync code in a serving process (a view, a consumer's database work) runs in
asgiref's thread pool. ``async_to_sync`` hands the coroutine to the serving
event loop and waits for it without a limit: if that loop stops meanwhile
(SIGTERM, once the drain is done), the thread waits for ever, and so does the
interpreter, which joins the pool's threads at exit. A relay worker that
disconnected just before a SIGTERM left every serving process hanging that way
until it was killed. Here the wait is bounded and a stopped loop is not waited
for. Outside a serving process (commands, Celery), ``async_to_sync`` runs the
coroutine on a loop of its own, as before.

``backends`` is the bottom layer, so every app can use this.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

from asgiref.sync import SyncToAsync, async_to_sync

# Long enough for a Redis round trip on a busy machine, short enough that a
# stopping process is not held up for long.
SEND_TIMEOUT = 5.0
LOOP_CHECK_SECONDS = 0.1


def run_on_layer(
    send: Callable[[], Coroutine[Any, Any, None]], timeout: float = SEND_TIMEOUT
) -> None:
    """Run ``send()`` (a channel-layer send) from sync code and wait for it.

    Raises ``TimeoutError`` if the serving loop has stopped or does not finish
    the send within `timeout` seconds; callers log it, as any failed send.
    """
    loop = _serving_loop()
    if loop is None:
        async_to_sync(_await)(send)
        return
    if not loop.is_running():
        raise TimeoutError("the serving event loop has stopped")
    future = asyncio.run_coroutine_threadsafe(send(), loop)
    deadline = time.monotonic() + timeout
    while True:
        # Look again now and then: the loop may stop while the send waits.
        left = deadline - time.monotonic()
        try:
            future.result(max(0.0, min(left, LOOP_CHECK_SECONDS)))
            return
        except concurrent.futures.TimeoutError:
            if left <= LOOP_CHECK_SECONDS or not loop.is_running():
                future.cancel()
                stopped = not loop.is_running()
                raise TimeoutError(
                    "the serving event loop has stopped"
                    if stopped
                    else f"the send did not finish in {timeout:g} s"
                ) from None


async def _await(send: Callable[[], Coroutine[Any, Any, None]]) -> None:
    await send()


def _serving_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop that ran this thread's sync code, if it is another thread's.

    The same lookup ``async_to_sync`` makes (asgiref records the loop of the
    ``sync_to_async`` call in a thread-local).
    """
    local = SyncToAsync.threadlocal
    loop: asyncio.AbstractEventLoop | None = getattr(local, "main_event_loop", None)
    if loop is None or getattr(local, "main_event_loop_pid", None) != os.getpid():
        return None
    return loop
