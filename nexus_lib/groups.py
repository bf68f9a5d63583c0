"""Listening to a Channels group from a long-lived task of a serving process."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)

# Redis channel-layer group membership expires (a day by default); re-join often.
GROUP_REJOIN_SECONDS = 600.0
# Channels of ours left in a group by an outage, kept to leave it later.
STALE_KEPT = 16


async def listen_to_group(group: str, handle: Callable[[dict[str, Any]], None]) -> None:
    """Pass every message sent to `group` to `handle`, until cancelled.

    Joins the group on a channel of its own, re-joins it periodically, starts
    over after a channel-layer error, and leaves the group when it stops. An
    exception from `handle` is logged and the message skipped.

    A channel that could not leave the group (the layer was down: Redis
    outage) is left once the layer answers again: otherwise it stays a member
    for the group's expiry (a day), every message to the group is also sent
    to it, and the layer buffers what comes to it in this process.
    """
    layer = get_channel_layer()
    if layer is None:
        return
    stale: list[str] = []  # channels of ours that failed to leave the group
    while True:
        channel = None
        try:
            new = await layer.new_channel()
            await layer.group_add(group, new)
            channel = new  # a member now: leaves the group when this ends
            while stale:
                await layer.group_discard(group, stale[-1])
                # channels_redis keeps what came for it meanwhile in a buffer
                # of this process that nothing will read.
                getattr(layer, "receive_buffer", {}).pop(stale.pop(), None)
            await _receive(layer, group, channel, handle)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.warning(
                "Lost the channel layer listening to %s; retrying", group, exc_info=True
            )
            await asyncio.sleep(1.0)
        finally:
            if channel is not None:
                try:
                    await layer.group_discard(group, channel)
                except Exception:
                    logger.info(
                        "Could not leave %s; leaving it once the channel layer answers",
                        group,
                        exc_info=True,
                    )
                    # Bounded: a member left behind expires with the group.
                    stale[:] = [*stale[-(STALE_KEPT - 1) :], channel]


async def _receive(
    layer: Any, group: str, channel: str, handle: Callable[[dict[str, Any]], None]
) -> None:
    loop = asyncio.get_running_loop()
    rejoin_at = loop.time() + GROUP_REJOIN_SECONDS
    while True:
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
        # cancellation that races with a message arriving, and stopping hangs.
        try:
            async with asyncio.timeout(max(0.1, rejoin_at - loop.time())):
                message = await layer.receive(channel)
        except TimeoutError:
            await layer.group_add(group, channel)
            rejoin_at = loop.time() + GROUP_REJOIN_SECONDS
            continue
        try:
            handle(message)
        except Exception:
            logger.warning(
                "Ignoring a message on %s: %r", group, message, exc_info=True
            )
        if loop.time() >= rejoin_at:
            # Messages every 0.1 s or faster never let the timeout fire: the
            # membership would expire (the layer's group_expiry) while busy.
            await layer.group_add(group, channel)
            rejoin_at = loop.time() + GROUP_REJOIN_SECONDS
