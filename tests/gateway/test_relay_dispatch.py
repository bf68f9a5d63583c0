"""RelayHub: a request to a worker's consumer and its answer back, in one process.

Fake consumers stand in for the worker's socket (the real ones are exercised
end to end in test_relay_e2e.py); these pin the hub's own rules: order and
gap detection, requeue before the first byte only, cancel on an early close.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
import pytest

from gateway.relay.dispatch import RelayHub, RelayRefused, RelayUnavailable
from routing.core import BackendSpec, ModelSpec, RouterSnapshot, Target
from routing.state import GatewayState

MODEL = "llama3:8b"


def _backend(name: str) -> BackendSpec:
    return BackendSpec(
        name=name,
        base_url=f"relay://{name}",
        kind="relay",
        status="healthy",
        max_concurrency=4,
        models=(ModelSpec(name=MODEL),),
    )


class FakeLink:
    """A consumer whose worker answers with `script(hub, request_id)`."""

    def __init__(self, hub: RelayHub, script: Callable[[RelayHub, str], None]) -> None:
        self.hub = hub
        self.script = script
        self.requests: list[dict[str, object]] = []
        self.cancelled: list[str] = []

    def start_request(self, request_id: str, frame: str, reply_to: str) -> None:
        self.requests.append(json.loads(frame))
        asyncio.get_running_loop().call_soon(self.script, self.hub, request_id)

    def cancel_request(self, request_id: str, reason: str) -> None:
        self.cancelled.append(request_id)

    async def leave(self) -> None:
        pass


def _deliver(hub: RelayHub, request_id: str, *events: tuple[str, object]) -> None:
    for seq, event in enumerate(events):
        hub.calls[request_id].deliver(seq, event)


def _serve_workers(hub: RelayHub, channels: dict[str, str]) -> dict[str, BackendSpec]:
    """Make `channels` the hub's connected workers (as the gateway's state says)."""
    backends = {name: _backend(name) for name in channels}
    state = GatewayState(
        version=1,
        routes=RouterSnapshot.build(backends=backends.values()),
        keys={},
        relay_channels=channels,
    )
    hub.state = lambda: state
    hub.max_reply = 1024
    return backends


async def _open(hub: RelayHub, names: tuple[str, ...], stream: bool) -> object:
    backends = _serve_workers(hub, {name: f"chan-{name}" for name in names})
    return await hub.open(
        Target(backends[names[0]], backends[names[0]].models[0]),
        "req",
        "/v1/chat/completions",
        b'{"model":"llama3:8b","stream":true}',
        {"content-type": "application/json", "authorization": "Bearer client"},
        stream,
    )


async def _read_all(response: object) -> bytes:
    out = b""
    async with asyncio.timeout(5):  # a missing end would hang the test
        async for data in response.content.iter_any():  # type: ignore[attr-defined]
            out += data
    return out


def test_a_stream_arrives_in_order_and_the_client_headers_stay_behind() -> None:
    async def run() -> tuple[bytes, list[dict[str, object]]]:
        hub = RelayHub()
        link = FakeLink(
            hub,
            lambda hub, rid: _deliver(
                hub,
                rid,
                ("chunk", "data: 1\n\n"),
                ("chunk", "data: 2\n\n"),
                ("complete", (200, {}, None)),
            ),
        )
        hub.attach("chan-a", link)
        response = await _open(hub, ("a",), stream=True)
        assert response.status == 200  # type: ignore[attr-defined]
        return await _read_all(response), link.requests

    body, requests = asyncio.run(run())
    assert body == b"data: 1\n\ndata: 2\n\n"
    assert requests[0]["headers"] == {"content-type": "application/json"}
    assert requests[0]["is_streaming"] is True


def test_a_lost_chunk_breaks_the_stream_instead_of_leaving_a_gap() -> None:
    async def run() -> None:
        hub = RelayHub()

        def skip_one(hub: RelayHub, rid: str) -> None:
            call = hub.calls[rid]
            call.deliver(0, ("chunk", "data: 1\n\n"))
            call.deliver(2, ("chunk", "data: 3\n\n"))  # 1 never came

        hub.attach("chan-a", FakeLink(hub, skip_one))
        response = await _open(hub, ("a",), stream=True)
        with pytest.raises(aiohttp.ClientPayloadError, match="lost"):
            await _read_all(response)

    asyncio.run(run())


def test_a_worker_gone_before_the_first_byte_hands_the_request_on() -> None:
    async def run() -> tuple[bytes, str, FakeLink]:
        hub = RelayHub()
        gone = FakeLink(hub, lambda hub, rid: _deliver(hub, rid, ("gone", "bye")))
        busy = FakeLink(
            hub,
            lambda hub, rid: _deliver(
                hub, rid, ("error", ("at capacity", "at_capacity"))
            ),
        )
        good = FakeLink(
            hub,
            lambda hub, rid: _deliver(hub, rid, ("complete", (200, {}, '{"ok":1}'))),
        )
        hub.attach("chan-a", gone)
        hub.attach("chan-b", busy)
        hub.attach("chan-c", good)
        response = await _open(hub, ("a", "b", "c"), stream=False)
        return await _read_all(response), response.backend_name, gone  # type: ignore[attr-defined]

    body, served_by, gone = asyncio.run(run())
    assert body == b'{"ok":1}'
    assert served_by == "c"
    assert gone.cancelled == []  # it was gone: nothing to cancel


def test_three_workers_at_most_then_unavailable() -> None:
    async def run() -> None:
        hub = RelayHub()
        for name in "abcd":
            hub.attach(
                f"chan-{name}",
                FakeLink(hub, lambda hub, rid: _deliver(hub, rid, ("gone", "x"))),
            )
        with pytest.raises(RelayUnavailable) as failed:
            await _open(hub, ("a", "b", "c", "d"), stream=False)
        assert str(failed.value).count("x") == 3

    asyncio.run(run())


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ('{"model": "llama3:8b"}'.encode("utf-16"), 400),
        # Within the body limit, over a frame once every quote is escaped.
        (b'{"model": "llama3:8b", "x": "' + b'\\"' * (5 * 1024**2) + b'"}', 413),
    ],
)
def test_a_body_no_worker_can_carry_is_refused_before_any_worker(
    body: bytes, status: int
) -> None:
    async def run() -> FakeLink:
        hub = RelayHub()
        link = FakeLink(hub, lambda hub, rid: _deliver(hub, rid, ("gone", "x")))
        hub.attach("chan-a", link)
        backends = _serve_workers(hub, {"a": "chan-a"})
        target = Target(backends["a"], backends["a"].models[0])
        with pytest.raises(RelayRefused) as refused:
            await hub.open(target, "req", "/v1/chat/completions", body, {}, False)
        assert refused.value.status == status
        return link

    assert asyncio.run(run()).requests == []


def test_closing_a_stream_early_cancels_it_at_the_worker() -> None:
    async def run() -> FakeLink:
        hub = RelayHub()
        link = FakeLink(
            hub, lambda hub, rid: _deliver(hub, rid, ("chunk", "data: 1\n\n"))
        )
        hub.attach("chan-a", link)
        response = await _open(hub, ("a",), stream=True)
        response.close()  # type: ignore[attr-defined]
        return link

    link = asyncio.run(run())
    assert len(link.cancelled) == 1
    assert link.cancelled[0].startswith("req.")


def test_a_worker_far_ahead_of_its_reader_is_cut_and_what_waited_is_dropped() -> None:
    """The red team's "worker streaming flat out": what a client has not read
    of a relay stream is bounded; past the bound the call ends at the worker
    and the reader gets an error instead of an ever longer queue."""

    async def run() -> tuple[FakeLink, RelayHub, object]:
        hub = RelayHub(max_unread=100)
        chunk = "data: " + "x" * 24 + "\n\n"  # 32 characters

        def flood(hub: RelayHub, rid: str) -> None:
            call = hub.calls[rid]
            call.deliver(0, ("chunk", chunk))
            call.deliver(1, ("chunk", chunk))

        link = FakeLink(hub, flood)
        hub.attach("chan-a", link)
        response = await _open(hub, ("a",), stream=True)
        first = await response.content.readany()  # type: ignore[attr-defined]
        assert first == chunk.encode()  # read: no longer waiting
        call = next(iter(hub.calls.values()))
        for seq in range(2, 6):  # 5 x 32 unread > 100
            call.deliver(seq, ("chunk", chunk))
        assert call.events.qsize() == 1  # the waiting chunks are gone
        call.deliver(6, ("chunk", chunk))  # later ones are dropped
        assert call.events.qsize() == 1
        with pytest.raises(aiohttp.ClientPayloadError, match="not read"):
            await _read_all(response)
        response.close()  # type: ignore[attr-defined]
        return link, hub, call

    link, hub, call = asyncio.run(run())
    assert link.cancelled == [call.request_id]  # type: ignore[attr-defined]
    assert hub.calls == {}


class FakeLayer:
    """Another serving process's consumers, over a channel layer: `answers`
    says what each channel's consumer does with a request (nothing: its
    process died; else the events it sends back, in order)."""

    def __init__(self, hub: RelayHub, answers: dict[str, list[tuple[str, object]]]):
        self.hub = hub
        self.answers = answers
        self.sent: list[tuple[str, dict[str, object]]] = []

    async def send(self, channel: str, message: dict[str, object]) -> None:
        self.sent.append((channel, message))
        rid = str(message["request_id"])
        if message["type"] == "relay.request":
            for seq, event in enumerate(self.answers.get(channel, [])):
                self.hub.calls[rid].deliver(seq, event)


def test_a_request_skips_a_dead_consumer_here_and_a_silent_process_there() -> None:
    async def run() -> tuple[bytes, str, list[str]]:
        hub = RelayHub(accept_timeout=0.2)
        layer = FakeLayer(
            hub,
            {
                "other!c": [("accepted", None), ("complete", (200, {}, '{"ok":1}'))],
            },
        )
        hub._layer = layer
        hub.reply_channel = "this!reply"
        hub._ready.set()
        # a: its consumer was in this process and left; b: another process
        # that never answers; c: another process that serves it.
        channels = {"a": "this!a", "b": "other!b", "c": "other!c"}
        backends = _serve_workers(hub, channels)
        async with asyncio.timeout(5):
            response = await hub.open(
                Target(backends["a"], backends["a"].models[0]),
                "req",
                "/v1/chat/completions",
                b'{"model":"llama3:8b"}',
                {},
                False,
            )
        body = await _read_all(response)
        await asyncio.sleep(0)  # the cancel goes out in a task of its own
        kinds = [f"{channel}:{message['type']}" for channel, message in layer.sent]
        return body, response.backend_name, kinds  # type: ignore[attr-defined]

    body, served_by, sent = asyncio.run(run())
    assert body == b'{"ok":1}'
    assert served_by == "c"
    # Nothing went to this process's gone consumer; the silent one was told
    # to cancel in case it wakes up.
    assert sorted(sent) == [
        "other!b:relay.cancel",
        "other!b:relay.request",
        "other!c:relay.request",
    ]


def test_a_worker_announced_gone_elsewhere_is_passed_by_at_once() -> None:
    """Another process's consumer lost its worker and said so over the load
    group; this process's snapshot still lists the worker for a moment. A
    request for it goes straight to the next worker instead of waiting out
    the accept timeout on a channel nobody reads (a client saw 5 s)."""

    async def run() -> tuple[bytes, str, list[str], float]:
        hub = RelayHub(accept_timeout=30)
        layer = FakeLayer(
            hub,
            {"other!b": [("accepted", None), ("complete", (200, {}, '{"ok":1}'))]},
        )
        hub._layer = layer
        hub.reply_channel = "this!reply"
        hub._ready.set()
        backends = _serve_workers(hub, {"a": "other!a", "b": "other!b"})
        hub.on_load_message(
            {
                "type": "relay.load",
                "backend": "a",
                "load": None,
                "gone_channel": "other!a",
            }
        )
        started = asyncio.get_running_loop().time()
        async with asyncio.timeout(5):
            response = await hub.open(
                Target(backends["a"], backends["a"].models[0]),
                "req",
                "/v1/chat/completions",
                b'{"model":"llama3:8b"}',
                {},
                False,
            )
        took = asyncio.get_running_loop().time() - started
        body = await _read_all(response)
        kinds = [f"{channel}:{message['type']}" for channel, message in layer.sent]
        return body, response.backend_name, kinds, took  # type: ignore[attr-defined]

    body, served_by, sent, took = asyncio.run(run())
    assert (body, served_by) == (b'{"ok":1}', "b")
    assert sent == ["other!b:relay.request"]  # nothing to the gone consumer
    assert took < 5  # not the accept timeout (30 s)


def test_a_reconnected_worker_is_not_taken_for_gone() -> None:
    """Gone is remembered by the consumer's channel: the same worker on a new
    socket (a new channel) is served at once."""

    async def run() -> tuple[bytes, list[str]]:
        hub = RelayHub(accept_timeout=30)
        layer = FakeLayer(
            hub,
            {"other!a2": [("accepted", None), ("complete", (200, {}, '{"ok":1}'))]},
        )
        hub._layer = layer
        hub.reply_channel = "this!reply"
        hub._ready.set()
        hub.on_load_message(
            {
                "type": "relay.load",
                "backend": "a",
                "load": None,
                "gone_channel": "other!a1",
            }
        )
        backends = _serve_workers(hub, {"a": "other!a2"})
        async with asyncio.timeout(5):
            response = await hub.open(
                Target(backends["a"], backends["a"].models[0]),
                "req",
                "/v1/chat/completions",
                b'{"model":"llama3:8b"}',
                {},
                False,
            )
        body = await _read_all(response)
        return body, [f"{channel}:{m['type']}" for channel, m in layer.sent]

    body, sent = asyncio.run(run())
    assert body == b'{"ok":1}'
    assert sent == ["other!a2:relay.request"]
