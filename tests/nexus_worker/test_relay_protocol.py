"""The worker relay's wire protocol: every message round-trips; bad frames say why."""

from __future__ import annotations

import json

import pytest

from nexus_worker import protocol
from nexus_worker.protocol import (
    Cancel,
    Error,
    GracefulShutdown,
    ModelsRefresh,
    ModelsUpdate,
    Ping,
    Pong,
    ProtocolError,
    Register,
    RegisterAck,
    Request,
    ResponseChunk,
    ResponseComplete,
    Unknown,
    UnsupportedVersion,
    decode,
    encode,
    websocket_url,
)

EVERY_MESSAGE = [
    Register(
        name="gpu-1",
        models=["llama3:8b", "qwen2.5:7b"],
        max_concurrency=4,
        load=1,
        backend_kind="ollama",
        version="0.1.0",
    ),
    ModelsUpdate(models=["llama3:8b"], load=2),
    ResponseChunk(request_id="r1", chunk='data: {"x": "é 😀"}\n\n'),
    ResponseComplete(
        request_id="r1", status=200, headers={"content-type": "text/event-stream"}
    ),
    ResponseComplete(request_id="r2", status=502, body='{"error": {}}'),
    Pong(timestamp=1700000000.5, load=3),
    Pong(timestamp=None, load=0),
    Error(message="backend down", request_id="r3", code="backend_unavailable"),
    Error(message="confused"),
    RegisterAck(worker_id="w-1", models=["llama3:8b"], heartbeat_interval=0.5),
    Request(
        request_id="r4",
        model="llama3:8b",
        endpoint="/v1/chat/completions",
        body='{"model": "llama3:8b", "stream": true}',
        headers={"content-type": "application/json"},
        is_streaming=True,
    ),
    Cancel(request_id="r4", reason="client disconnected"),
    Ping(timestamp=1700000000.0),
    Ping(timestamp=1700000000.0, interval=20.0),
    GracefulShutdown(reason="maintenance", timeout_secs=30.0),
    GracefulShutdown(),
    ModelsRefresh(),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: protocol.Message) -> None:
    text = encode(message)
    assert json.loads(text)["type"] == message.type
    assert decode(text) == message


def test_frames_match_the_spec_tables() -> None:
    assert json.loads(encode(Register(name="a", models=["m"], max_concurrency=2))) == {
        "type": "register",
        "name": "a",
        "models": ["m"],
        "max_concurrency": 2,
        "load": 0,
        "protocol_version": 1,
    }
    assert json.loads(encode(ResponseComplete(request_id="r", status=200))) == {
        "type": "response_complete",
        "request_id": "r",
        "status": 200,
        "headers": {},
        "body": None,
    }
    assert json.loads(encode(GracefulShutdown())) == {
        "type": "graceful_shutdown",
        "reason": None,
        "timeout_secs": None,
    }
    assert json.loads(encode(ModelsRefresh())) == {"type": "models_refresh"}


def test_non_ascii_text_stays_utf8_on_the_wire() -> None:
    text = encode(ResponseChunk(request_id="r", chunk="héllo 😀"))
    assert "héllo 😀" in text


def test_unknown_type_decodes_to_unknown_and_extra_fields_are_ignored() -> None:
    assert decode('{"type": "telemetry", "x": 1}') == Unknown(type_name="telemetry")
    assert decode('{"type": "ping", "timestamp": 1.0, "future": true}') == Ping(1.0)


def test_a_long_unknown_type_is_cut_for_the_log() -> None:
    unknown = decode(json.dumps({"type": "x" * 10_000}))
    assert isinstance(unknown, Unknown)
    assert len(unknown.type_name) == 64


@pytest.mark.parametrize(
    ("frame", "says"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"kind": "ping"}', 'no "type"'),
        ('{"type": 7}', 'no "type"'),
        ('{"type": "ping"}', "ping: missing field 'timestamp'"),
        ('{"type": "ping", "timestamp": "now"}', "ping.timestamp: not a number"),
        ('{"type": "ping", "timestamp": true}', "ping.timestamp: not a number"),
        (
            '{"type": "register", "name": "", "models": [], "max_concurrency": 1}',
            "register.name: empty",
        ),
        (
            '{"type": "register", "name": "a", "models": "m", "max_concurrency": 1}',
            "register.models: not a list",
        ),
        (
            '{"type": "register", "name": "a", "models": [1], "max_concurrency": 1}',
            "register.models: not a string",
        ),
        (
            '{"type": "register", "name": "a", "models": [], "max_concurrency": 0}',
            "register.max_concurrency: 0 is not in 1..10000",
        ),
        (
            '{"type": "register", "name": "a", "models": [], "max_concurrency": 1.5}',
            "register.max_concurrency: not an integer",
        ),
        ('{"type": "pong", "timestamp": null, "load": -1}', "pong.load: -1 is not"),
        (
            '{"type": "response_complete", "request_id": "r", "status": 1000}',
            "response_complete.status: 1000 is not in 100..599",
        ),
        (
            json.dumps(
                {
                    "type": "response_complete",
                    "request_id": "r",
                    "status": 200,
                    "headers": {"a": 1},
                }
            ),
            "response_complete.headers: not a string",
        ),
        (
            json.dumps(
                {
                    "type": "request",
                    "request_id": "r",
                    "model": "m",
                    "endpoint": "/v1/completions",
                    "body": "{}",
                    "is_streaming": "yes",
                }
            ),
            "request.is_streaming: not a boolean",
        ),
        ('{"type": "response_chunk", "chunk": "x"}', "missing field 'request_id'"),
        (
            json.dumps(
                {"type": "response_chunk", "request_id": "r" * 257, "chunk": ""}
            ),
            "response_chunk.request_id: longer than 256 characters",
        ),
    ],
)
def test_bad_frames_raise_a_clear_protocol_error(frame: str, says: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode(frame)
    assert says in str(caught.value)


def test_counts_are_bounded() -> None:
    too_many_models = {"type": "models_update", "models": ["m"] * 2001, "load": 0}
    with pytest.raises(ProtocolError, match="more than 2000 models"):
        decode(json.dumps(too_many_models))
    headers = {f"h{i}": "v" for i in range(65)}
    frame = {"type": "response_complete", "request_id": "r", "status": 200}
    with pytest.raises(ProtocolError, match="more than 64 headers"):
        decode(json.dumps({**frame, "headers": headers}))


def test_a_frame_over_the_limit_is_refused_before_parsing() -> None:
    huge = "x" * (protocol.MAX_FRAME_BYTES + 1)
    with pytest.raises(ProtocolError, match="over"):
        decode(huge)


def _pong_with(value: str) -> str:
    return '{"type":"pong","load":0,"x":' + value + "}"


@pytest.mark.parametrize(
    "frame",
    [
        # The red team's frame: json.loads raised RecursionError (issue 27).
        _pong_with("[" * 100_000 + "]" * 100_000),
        "[" * 100_000,  # never closed: the parser would still recurse
        _pong_with("[" * 32 + "]" * 32),  # 33 deep with the frame's object
        _pong_with('[{"a":' * 16 + "1" + "}]" * 16),
        _pong_with("[1," * 40_000 + "]" * 40_000).encode(),
    ],
)
def test_a_frame_nested_too_deep_is_refused_before_parsing(frame: str) -> None:
    with pytest.raises(protocol.FrameTooDeep, match="nested more than 32 deep"):
        decode(frame)


@pytest.mark.parametrize(
    "value",
    [
        "[" * 31 + "]" * 31,  # 32 deep
        "[" + "[[]]," * 5000 + "[]]",  # wide, not deep
        '"' + "[" * 1000 + '"',  # brackets in a string are text
        r'"\\\"' + "{" * 1000 + r'\\"',  # escapes do not end the string
        '["\udfff",' + "{}," * 100 + "[]]",
    ],
)
def test_frames_nested_up_to_the_bound_decode(value: str) -> None:
    assert decode(_pong_with(value)) == Pong(load=0)


def test_a_broken_frame_that_opens_a_few_levels_is_only_not_json() -> None:
    frame = _pong_with("[[[" + "[1]," * 100)
    with pytest.raises(ProtocolError, match="not JSON"):
        decode(frame)


def test_another_protocol_version_is_unsupported() -> None:
    frame = {
        "type": "register",
        "name": "a",
        "models": [],
        "max_concurrency": 1,
        "protocol_version": 2,
    }
    with pytest.raises(UnsupportedVersion, match="protocol_version 2 is not 1"):
        decode(json.dumps(frame))


def test_a_chunk_of_the_largest_size_fits_in_a_frame_even_fully_escaped() -> None:
    worst = ResponseChunk(request_id="r" * 256, chunk="\x01" * protocol.MAX_CHUNK_CHARS)
    assert len(encode(worst).encode()) <= protocol.MAX_FRAME_BYTES
    # Under plain daphne too (its default message limit, not nexus_run's).
    assert len(encode(worst).encode()) <= protocol.DAPHNE_DEFAULT_MESSAGE_BYTES


def test_close_codes_and_names() -> None:
    assert protocol.CloseCode.AUTH_FAILED == 4001
    assert protocol.CloseCode.UNSUPPORTED_VERSION == 4002
    assert protocol.CloseCode.BAD_FRAME == 4003
    assert protocol.CloseCode.TOO_BIG == 1009
    assert protocol.SECRET_HEADER == "x-worker-secret"
    assert protocol.PROTOCOL_VERSION == 1
    assert protocol.DEFAULT_HEARTBEAT_SECONDS == 5.0


@pytest.mark.parametrize(
    ("base", "url"),
    [
        ("http://gateway:8000", "ws://gateway:8000/ws/workers/"),
        ("http://gateway:8000/", "ws://gateway:8000/ws/workers/"),
        ("https://llm.example.com", "wss://llm.example.com/ws/workers/"),
        ("HTTPS://llm.example.com/nexus/", "wss://llm.example.com/nexus/ws/workers/"),
        ("http://[::1]:8000/a/b", "ws://[::1]:8000/a/b/ws/workers/"),
        ("wss://h/p", "wss://h/p/ws/workers/"),
    ],
)
def test_websocket_url_from_the_gateway_base_url(base: str, url: str) -> None:
    assert websocket_url(base) == url


def test_websocket_url_carries_the_worker_name() -> None:
    assert (
        websocket_url("http://g:8000", name="gpu box")
        == "ws://g:8000/ws/workers/?name=gpu+box"
    )


@pytest.mark.parametrize("base", ["ftp://h", "gateway:8000", "http://", ""])
def test_websocket_url_refuses_what_is_not_an_http_url(base: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        websocket_url(base)


def test_a_bad_frame_names_its_request_so_that_request_can_fail_at_once() -> None:
    frame = {"type": "request", "request_id": "r9", "model": "m", "body": "{}"}
    with pytest.raises(ProtocolError, match="missing field 'endpoint'") as caught:
        decode(json.dumps(frame))
    assert caught.value.request_id == "r9"
    with pytest.raises(ProtocolError) as caught:
        decode(json.dumps({"type": "ping", "timestamp": "x", "request_id": 5}))
    assert caught.value.request_id is None


def test_request_ids_leave_room_for_a_client_id_and_an_attempt_suffix() -> None:
    # The proxy accepts client X-Request-IDs of up to 128 characters and the
    # gateway numbers each attempt after it.
    request_id = "c" * 128 + ".12345"
    message = Cancel(request_id=request_id)
    assert decode(encode(message)) == message


@pytest.mark.parametrize(
    "value",
    [
        # The red team's frames (issue 27): tiny elements, millions of them;
        # json.loads took seconds of the gateway's event loop for one.
        "[" + "0," * 100_000 + "0]",
        "{" + ",".join(f'"{n}":0' for n in range(5000)) + "}",
        "[" + '"",' * 20_000 + '""]',  # strings are values too
    ],
    ids=["numbers", "members", "strings"],
)
def test_a_frame_of_too_many_values_is_refused_before_parsing(value: str) -> None:
    with pytest.raises(protocol.FrameTooWide, match="more than 8192 values"):
        decode(_pong_with(value))


def test_big_frames_of_few_values_decode() -> None:
    models = [f"model-{n}" for n in range(2000)]
    register = {"type": "register", "name": "a", "models": models, "max_concurrency": 1}
    assert decode(json.dumps(register)) == Register(
        name="a", models=models, max_concurrency=1
    )
    # A reply body of JSON with a million commas, quotes and brackets is
    # one string: one value.
    body = json.dumps(
        {"data": [{"embedding": [0.5] * 1000, "i": n} for n in range(500)]}
    )
    frame = encode(ResponseComplete(request_id="r", status=200, body=body))
    assert decode(frame) == ResponseComplete(request_id="r", status=200, body=body)


STATE = protocol.BackendState(
    loaded=(
        protocol.LoadedModel("a", vram_bytes=5 * 10**9, context_length=8192),
        protocol.LoadedModel("b", expires_in=299.5),
    ),
    memory_bytes=24 * 10**9,
    slots=4,
    busy_slots=1,
)


@pytest.mark.parametrize(
    "message",
    [
        Pong(load=1, timestamp=2.0, state=STATE),
        Pong(load=0, state=protocol.BackendState()),
        Register(name="gpu", models=["a", "b"], max_concurrency=4, state=STATE),
    ],
    ids=["pong", "pong with nothing known", "register"],
)
def test_a_backend_state_round_trips(message: protocol.Message) -> None:
    assert decode(encode(message)) == message


def test_an_older_worker_without_a_state_still_decodes_and_an_older_gateway_skips_it() -> (
    None
):
    assert decode('{"type":"pong","load":2,"timestamp":1.0}') == Pong(
        load=2, timestamp=1.0
    )
    # What an older gateway does with a newer worker's pong: a known type's
    # extra fields are ignored (shown by a field neither side knows).
    frame = json.loads(encode(Pong(load=0, state=STATE)))
    assert decode(json.dumps({**frame, "from_the_future": {"x": 1}})) == Pong(
        load=0, state=STATE
    )
    state = {"loaded": [{"name": "a", "size_on_mars": 3}], "gpu_temperature": 80}
    assert decode(json.dumps({"type": "pong", "load": 0, "state": state})) == Pong(
        load=0, state=protocol.BackendState(loaded=(protocol.LoadedModel("a"),))
    )


@pytest.mark.parametrize(
    ("state", "says"),
    [
        ({"loaded": [{"name": f"m{i}"} for i in range(65)]}, "more than 64 models"),
        ({"memory_bytes": 10**15 + 1}, "memory_bytes: 1000000000000001 is not in"),
        ({"loaded": [{"name": "a", "vram_bytes": 10**18}]}, "vram_bytes"),
        ({"loaded": [{"name": "a", "vram_bytes": -1}]}, "vram_bytes"),
        ({"loaded": [{"name": ""}]}, "name: empty"),
        ({"loaded": [{"vram_bytes": 1}]}, "missing field 'name'"),
        ({"loaded": [{"name": "a", "expires_in": 1e300}]}, "expires_in"),
        ({"slots": 10_001}, "slots"),
        ({"busy_slots": True}, "busy_slots: not an integer"),
        ({"loaded": {"a": 1}}, "loaded: not a list"),
        ([], "state: not an object"),
    ],
)
def test_a_hostile_state_is_refused_with_a_clear_error(
    state: object, says: str
) -> None:
    """A worker cannot claim a petabyte, a thousand models loaded, or a
    negative size: the frame is dropped (and logged by the consumer)."""
    with pytest.raises(ProtocolError) as caught:
        decode(json.dumps({"type": "pong", "load": 0, "state": state}))
    assert says in str(caught.value)


def test_a_model_named_twice_counts_once() -> None:
    state = {"loaded": [{"name": "a", "vram_bytes": 1}, {"name": "a", "vram_bytes": 2}]}
    pong = decode(json.dumps({"type": "pong", "load": 0, "state": state}))
    assert isinstance(pong, Pong) and pong.state is not None
    assert pong.state.loaded == (protocol.LoadedModel("a", vram_bytes=1),)
