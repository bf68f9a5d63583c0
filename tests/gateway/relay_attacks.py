"""A hostile holder of a worker credential, as a process of its own.

``python -m tests.gateway.relay_attacks KIND URL`` with the credential in
``NEXUS_WORKER_SECRET`` (the red team's attacks, issue 27):

* ``reconnect``: connect, register, leave; ``--count`` times, at most
  ``--rate`` connects a second;
* ``tiny`` / ``chunks``: register, then send frames back to back (of tiny JSON
  elements, or big valid response chunks) until the gateway closes the
  socket; connect again (at most ``--rate`` a second) until ``--seconds``
  passed.

Prints one JSON line at the end: how many attempts got which outcome
("refused CODE" before registering, "registered", then "cut CODE" or "still
open" at the end) and the frames sent. A process of its own, so that its
CPU is not the test's (the test times another worker's requests meanwhile).
Standard library, aiohttp and the wire protocol only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections import Counter

import aiohttp

from nexus_worker import protocol

TINY = '{"type":"pong","load":0,"x":[' + "0," * 450_000 + "0]}"  # under 1 MiB
CHUNK = protocol.encode(protocol.ResponseChunk(request_id="none", chunk="x" * 900_000))


def _register(name: str) -> str:
    register = protocol.Register(name=name, models=["hostile"], max_concurrency=1)
    return protocol.encode(register)


async def _attempt(
    http: aiohttp.ClientSession,
    url: str,
    secret: str,
    frame: str,
    seen: Counter[str],
    deadline: float,
    grace: float,
) -> None:
    headers = {protocol.SECRET_HEADER: secret}
    async with http.ws_connect(url, headers=headers, max_msg_size=0) as ws:
        await ws.send_str(_register("hostile"))
        first = await ws.receive(timeout=30)
        if first.type != aiohttp.WSMsgType.TEXT:
            seen[f"refused {ws.close_code}"] += 1
            return
        seen["registered"] += 1
        if not frame:
            return

        async def read() -> None:
            async for _ in ws:
                pass

        reader = asyncio.create_task(read())
        while not ws.closed and not reader.done() and time.monotonic() < deadline:
            try:
                await ws.send_str(frame)
            except (ConnectionError, aiohttp.ClientError):
                break
            seen["frames"] += 1
        if not reader.done():
            # A frame sent just before the deadline may not be read yet (the
            # gateway reads a worker over its byte rate only as the rate
            # allows): the socket is judged once the gateway had time to.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), timeout=grace)
        if not reader.done():
            seen["still open"] += 1
            reader.cancel()
            return
        seen[f"cut {ws.close_code}"] += 1


async def attack(kind: str, url: str, count: int, seconds: float, rate: float) -> None:
    secret = os.environ["NEXUS_WORKER_SECRET"]
    frame = {"reconnect": "", "tiny": TINY, "chunks": CHUNK}[kind]
    seen: Counter[str] = Counter()
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        attempts = 0
        while attempts < count and time.monotonic() - started < seconds:
            due = started + attempts / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            attempts += 1
            # Only a frame refused when read needs time after the deadline;
            # the other attacks end there (the test's genuine worker answers
            # no ping meanwhile: its health must not go stale).
            grace = 15.0 if kind == "tiny" else 0.0
            await _attempt(http, url, secret, frame, seen, started + seconds, grace)
    print(json.dumps(dict(seen)), flush=True)  # noqa: T201


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("reconnect", "tiny", "chunks"))
    parser.add_argument("url")
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--rate", type=float, default=30.0)
    args = parser.parse_args()
    asyncio.run(attack(args.kind, args.url, args.count, args.seconds, args.rate))


if __name__ == "__main__":
    main()
