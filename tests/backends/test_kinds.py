"""Each kind's adapter probes and lists a real mock server of that kind."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from backends.kinds import (
    KINDS,
    BackendLoading,
    Endpoint,
    ProbeFailed,
    ProbeStatus,
    describe_error,
    get_adapter,
)
from backends.models import BackendKind
from tests.backends.mock_fleet import KindMock, closed_port_url, running_mocks

pytestmark = pytest.mark.mode_independent

OPENAI_KEY = "sk-openai-Zq8v3LmT0pXw"
ANTHROPIC_KEY = "sk-ant-api03-T0pXwZq8v3Lm"


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, KindMock]]:
    specs = (
        ("openai", "--models", "gpt-4o-mini", "--api-key", OPENAI_KEY),
        (
            "ollama",
            "--models",
            "llama3:8b,llava:7b",
            "--vision-models",
            "llava:7b",
            "--tool-models",
            "llama3:8b",
            "--loaded-models",
            "llama3:8b",
            "--context-length",
            "4096",
        ),
        ("vllm", "--models", "meta-llama/Llama-3.1-8B", "--context-length", "16384"),
        (
            "llamacpp",
            "--models",
            "qwen2.5-7b",
            "--context-length",
            "4096",
            "--vision-models",
            "qwen2.5-7b",
        ),
        ("anthropic", "--models", "claude-sonnet-4", "--api-key", ANTHROPIC_KEY),
    )
    with running_mocks(*specs) as mocks:
        yield {mock.kind: mock for mock in mocks}


@pytest.fixture(autouse=True)
def _fresh_mocks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "fleet" in request.fixturenames:
        for mock in request.getfixturevalue("fleet").values():
            mock.reset()


def endpoint(mock: KindMock, api_key: str = "") -> Endpoint:
    return Endpoint(
        name=f"{mock.kind}-1", kind=mock.kind, base_url=mock.base_url, api_key=api_key
    )


async def test_every_backend_kind_has_an_adapter() -> None:
    assert set(KINDS) == set(BackendKind.values)


@pytest.mark.parametrize(
    ("kind", "key"),
    [
        ("openai", OPENAI_KEY),
        ("ollama", ""),
        ("vllm", ""),
        ("llamacpp", ""),
        ("anthropic", ANTHROPIC_KEY),
    ],
)
async def test_probe_finds_a_running_server_of_each_kind_up(
    fleet: dict[str, KindMock], kind: str, key: str
) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        result = await get_adapter(kind).probe(client, endpoint(fleet[kind], key))
    assert result.status is ProbeStatus.UP
    assert result.latency_ms is not None and result.latency_ms >= 0
    assert result.error == ""


async def test_openai_probe_sends_the_key_and_fails_on_a_wrong_one(
    fleet: dict[str, KindMock],
) -> None:
    mock = fleet["openai"]
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(ProbeFailed) as caught:
            await get_adapter("openai").probe(client, endpoint(mock, "sk-wrong"))
    message = str(caught.value)
    assert "authentication failed" in message
    assert "401" in message
    assert "sk-wrong" not in message


async def test_anthropic_probe_authenticates_with_x_api_key(
    fleet: dict[str, KindMock],
) -> None:
    mock = fleet["anthropic"]
    adapter = get_adapter("anthropic")
    async with httpx.AsyncClient(timeout=5) as client:
        await adapter.probe(client, endpoint(mock, ANTHROPIC_KEY))
        with pytest.raises(ProbeFailed, match="authentication failed"):
            await adapter.probe(client, endpoint(mock, "sk-ant-wrong"))
        with pytest.raises(ProbeFailed, match="no API key"):
            await adapter.probe(client, endpoint(mock))
    seen = mock.http.get("/_mock/stats").json()["last_requests"]
    assert seen[0]["path"] == "/v1/models?limit=1"
    assert seen[0]["headers"]["x-api-key"] == ANTHROPIC_KEY
    assert seen[0]["headers"]["anthropic-version"]


async def test_anthropic_models_come_from_configuration(
    fleet: dict[str, KindMock],
) -> None:
    adapter = get_adapter("anthropic")
    assert not adapter.discovers_models
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(ProbeFailed, match="configuration"):
            await adapter.list_models(client, endpoint(fleet["anthropic"], "k"))


async def test_ollama_probe_reports_which_models_are_loaded(
    fleet: dict[str, KindMock],
) -> None:
    mock = fleet["ollama"]
    async with httpx.AsyncClient(timeout=5) as client:
        result = await get_adapter("ollama").probe(client, endpoint(mock))
        assert result.loaded_models == {"llama3:8b"}
        mock.configure(loaded_models=[])
        result = await get_adapter("ollama").probe(client, endpoint(mock))
    assert result.loaded_models == frozenset()


async def test_ollama_listing_has_context_vision_tools_and_loaded(
    fleet: dict[str, KindMock],
) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        models = await get_adapter("ollama").list_models(
            client, endpoint(fleet["ollama"])
        )
    by_name = {model.name: model for model in models}
    assert set(by_name) == {"llama3:8b", "llava:7b"}
    llama, llava = by_name["llama3:8b"], by_name["llava:7b"]
    assert (llama.context_length, llama.supports_tools, llama.supports_vision) == (
        4096,
        True,
        False,
    )
    assert (llava.supports_vision, llava.supports_tools) == (True, False)
    assert llama.loaded is True and llava.loaded is False
    assert llama.supports_json_mode is True


async def test_vllm_listing_takes_max_model_len_as_context(
    fleet: dict[str, KindMock],
) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        models = await get_adapter("vllm").list_models(client, endpoint(fleet["vllm"]))
    assert [(m.name, m.context_length, m.loaded) for m in models] == [
        ("meta-llama/Llama-3.1-8B", 16384, True)
    ]


async def test_vllm_probe_also_checks_health(fleet: dict[str, KindMock]) -> None:
    mock = fleet["vllm"]
    async with httpx.AsyncClient(timeout=5) as client:
        await get_adapter("vllm").probe(client, endpoint(mock))
    paths = [r["path"] for r in mock.http.get("/_mock/stats").json()["last_requests"]]
    # /metrics too: the mock has none unless kv_cache_usage is set (a 404).
    assert paths == ["/health", "/v1/models", "/metrics"]


async def test_vllm_reports_memory_pressure_from_its_kv_cache_usage(
    fleet: dict[str, KindMock],
) -> None:
    mock = fleet["vllm"]
    async with httpx.AsyncClient(timeout=5) as client:
        without = await get_adapter("vllm").probe(client, endpoint(mock))
        mock.configure(kv_cache_usage=0.5)
        relaxed = await get_adapter("vllm").probe(client, endpoint(mock))
        mock.configure(kv_cache_usage=0.97)
        pressed = await get_adapter("vllm").probe(client, endpoint(mock))

    assert without.status is ProbeStatus.UP and without.memory is None
    assert relaxed.memory is not None and not relaxed.memory.pressure
    assert pressed.memory is not None and pressed.memory.pressure


async def test_llamacpp_probe_reports_its_slots_and_version_in_one_read(
    fleet: dict[str, KindMock],
) -> None:
    mock = fleet["llamacpp"]
    mock.configure(slots=4)
    async with httpx.AsyncClient(timeout=5) as client:
        result = await get_adapter("llamacpp").probe(client, endpoint(mock))

    assert result.memory is not None and result.memory.slots == 4
    assert result.version == "b5000-mock"


async def test_ollama_probe_sums_the_memory_of_every_loaded_model(
    fleet: dict[str, KindMock],
) -> None:
    mock = fleet["ollama"]
    # Another client's 20 GB model beside ours (4 GB), which Nexus does not list.
    mock.configure(
        model_sizes={"llama3:8b": 4.0, "llava:7b": 5.0},
        resident_models={"qwen2.5:32b": 20.0},
    )
    async with httpx.AsyncClient(timeout=5) as client:
        result = await get_adapter("ollama").probe(client, endpoint(mock))
        models = await get_adapter("ollama").list_models(client, endpoint(mock))

    assert result.loaded_models == {"llama3:8b", "qwen2.5:32b"}
    assert result.memory is not None and result.memory.used_bytes == 24_000_000_000
    # Llama 3 8B's KV cache: 32 layers x 8 KV heads x (128 + 128) x 2 bytes.
    assert {m.kv_bytes_per_token for m in models} == {131_072}


async def test_llamacpp_listing_prefers_the_slot_context_over_the_trained_one(
    fleet: dict[str, KindMock],
) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        models = await get_adapter("llamacpp").list_models(
            client, endpoint(fleet["llamacpp"])
        )
    (model,) = models
    # The mock trains on 4x the context it runs with, as real servers often do.
    assert model.context_length == 4096
    assert model.supports_vision is True
    assert model.supports_tools is False


async def test_llamacpp_loading_is_a_state_not_a_failure(
    fleet: dict[str, KindMock],
) -> None:
    mock = fleet["llamacpp"]
    mock.configure(loading=True)
    adapter = get_adapter("llamacpp")
    async with httpx.AsyncClient(timeout=5) as client:
        result = await adapter.probe(client, endpoint(mock))
        assert result.status is ProbeStatus.LOADING
        assert "loading" in result.error
        with pytest.raises(BackendLoading):
            await adapter.list_models(client, endpoint(mock))
        mock.configure(loading=False)
        result = await adapter.probe(client, endpoint(mock))
    assert result.status is ProbeStatus.UP


async def test_probing_a_server_of_another_kind_says_so(
    fleet: dict[str, KindMock],
) -> None:
    wrong = Endpoint(name="x", kind="ollama", base_url=fleet["vllm"].base_url)
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(ProbeFailed) as caught:
            await get_adapter("ollama").probe(client, wrong)
    assert "HTTP 404 from GET /api/ps" in str(caught.value)
    assert "ollama server" in str(caught.value)


async def test_a_base_url_ending_in_v1_reaches_the_same_server(
    fleet: dict[str, KindMock],
) -> None:
    mock = fleet["ollama"]
    with_v1 = Endpoint(name="x", kind="ollama", base_url=mock.base_url + "/v1/")
    async with httpx.AsyncClient(timeout=5) as client:
        result = await get_adapter("ollama").probe(client, with_v1)
    assert result.status is ProbeStatus.UP


async def test_a_refused_connection_is_described_plainly() -> None:
    dead = Endpoint(name="x", kind="openai", base_url=closed_port_url())
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.ConnectError) as caught:
            await get_adapter("openai").probe(client, dead)
    assert describe_error(caught.value) == "connection refused"
    assert describe_error(TimeoutError(), timeout=2.5) == "no answer within 2.5 s"


def transport_client(
    routes: dict[str, Callable[[httpx.Request], httpx.Response]],
) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        return routes[request.url.path](request)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_ollama_num_ctx_parameter_wins_over_the_trained_context() -> None:
    # Real Ollama answers from disk; these shapes are not worth a mock knob each.
    def show(request: httpx.Request) -> httpx.Response:
        name = json.loads(request.content)["model"]
        if name == "tuned":
            return httpx.Response(
                200,
                json={
                    "parameters": 'num_ctx 16384\nstop "<|eot_id|>"',
                    "model_info": {"qwen2.context_length": 32768},
                    "capabilities": ["completion", "tools"],
                },
            )
        if name == "old-vision":
            return httpx.Response(
                200,
                json={
                    "model_info": {"llama.context_length": 4096},
                    "projector_info": {"clip.has_vision_encoder": True},
                },
            )
        return httpx.Response(404, json={"error": f"model '{name}' not found"})

    routes = {
        "/api/tags": lambda _: httpx.Response(
            200,
            json={"models": [{"name": n} for n in ("tuned", "old-vision", "broken")]},
        ),
        "/api/ps": lambda _: httpx.Response(200, json={"models": []}),
        "/api/show": show,
    }
    async with transport_client(routes) as client:
        models = await get_adapter("ollama").list_models(
            client, Endpoint(name="o", kind="ollama", base_url="http://ollama:11434")
        )
    by_name = {m.name: m for m in models}
    assert by_name["tuned"].context_length == 16384
    assert by_name["tuned"].supports_tools is True
    assert by_name["old-vision"].context_length == 4096
    assert by_name["old-vision"].supports_vision is True
    assert by_name["old-vision"].supports_tools is None
    # One unreadable model does not hide the others, nor itself.
    assert by_name["broken"].context_length is None


async def test_openai_listing_reads_context_fields_other_servers_add() -> None:
    routes = {
        "/v1/models": lambda _: httpx.Response(
            200,
            json={
                "data": [
                    {"id": "a", "context_length": 128000},
                    {"id": "b", "context_window": 32768},
                    {"id": "c"},
                    {"id": "d", "context_length": "lots"},
                    {"no_id": True},
                ]
            },
        )
    }
    async with transport_client(routes) as client:
        models = await get_adapter("openai").list_models(
            client, Endpoint(name="o", kind="openai", base_url="https://api.example")
        )
    assert [(m.name, m.context_length) for m in models] == [
        ("a", 128000),
        ("b", 32768),
        ("c", None),
        ("d", None),
    ]
    assert all(m.supports_json_mode is None and m.loaded is None for m in models)


async def test_an_answer_that_is_not_a_model_list_is_a_failure() -> None:
    routes = {"/v1/models": lambda _: httpx.Response(200, text="<html>login</html>")}
    async with transport_client(routes) as client:
        with pytest.raises(ProbeFailed, match="did not answer JSON"):
            await get_adapter("openai").probe(
                client, Endpoint(name="o", kind="openai", base_url="http://x")
            )
