"""GET /metrics: Prometheus text from a real serving process, and who may read it."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import openai
import pytest

from backends.models import Backend, BackendModel, HealthStatus
from tests.conftest import MockBackendProcess, NexusServer
from usage.models import ApiKey, ModelPrice

pytestmark = pytest.mark.django_db(transaction=True)


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the one series of `name` whose labels include `labels`."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if labels.items() <= found.items():
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in:\n{text}")


def _setup(mock: MockBackendProcess) -> str:
    backend = Backend.objects.create(
        name="mock-metrics", base_url=mock.base_url, status=HealthStatus.HEALTHY
    )
    BackendModel.objects.create(backend=backend, name="llama3:8b")
    Backend.objects.create(
        name="gpu-down", base_url="http://127.0.0.1:9", status=HealthStatus.UNHEALTHY
    )
    _, key = ApiKey.objects.create_key("metrics")
    return key


def test_metrics_count_requests_tokens_latency_and_health(
    mock_backend: MockBackendProcess,
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    key = _setup(mock_backend)
    server = nexus_server_factory()
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    tokens_out = 0
    for n in range(3):
        reply = sdk.chat.completions.create(
            model="llama3:8b", messages=[{"role": "user", "content": f"hi {n}"}]
        )
        tokens_out += reply.usage.completion_tokens
    list(
        sdk.chat.completions.create(
            model="llama3:8b", messages=[{"role": "user", "content": "s"}], stream=True
        )
    )
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(
            model="no-such-model-1234", messages=[{"role": "user", "content": "x"}]
        )

    response = httpx.get(f"{server.base_url}/metrics")

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    ok = {"surface": "chat", "model": "llama3:8b", "backend": "mock-metrics"}
    assert sample(text, "nexus_requests_total", status="200", **ok) == 4
    # A model nobody serves is counted, under a bounded label.
    assert sample(text, "nexus_requests_total", status="404", model="unknown") == 1
    out = sample(text, "nexus_tokens_total", direction="out", model="llama3:8b")
    assert out > tokens_out  # the three replies plus the stream
    assert (
        sample(
            text,
            "nexus_request_duration_seconds_count",
            surface="chat",
            model="llama3:8b",
        )
        == 4
    )
    assert (
        sample(text, "nexus_time_to_first_byte_seconds_count", model="llama3:8b") == 4
    )
    assert sample(text, "nexus_backend_up", backend="mock-metrics") == 1
    assert sample(text, "nexus_backend_up", backend="gpu-down") == 0
    assert sample(text, "nexus_in_flight_requests", backend="mock-metrics") == 0
    assert "no-such-model-1234" not in text


def test_metrics_are_refused_outside_the_allowed_networks_without_the_token(
    nexus_server_factory: Callable[..., NexusServer],
) -> None:
    server = nexus_server_factory(
        NEXUS_METRICS_ALLOW="10.0.0.0/8", NEXUS_METRICS_TOKEN="scrape-secret"
    )

    refused = httpx.get(f"{server.base_url}/metrics")
    wrong = httpx.get(
        f"{server.base_url}/metrics", headers={"authorization": "Bearer nope"}
    )
    allowed = httpx.get(
        f"{server.base_url}/metrics",
        headers={"authorization": "Bearer scrape-secret"},
    )

    assert refused.status_code == 403
    assert "NEXUS_METRICS_ALLOW" in refused.text
    assert wrong.status_code == 403
    assert allowed.status_code == 200
    assert "nexus_requests_total" in allowed.text or "nexus_requests" in allowed.text


@pytest.mark.parametrize("per_key", [False, True])
def test_spend_is_shown_per_key_only_when_asked(
    mock_backend: MockBackendProcess,
    nexus_server_factory: Callable[..., NexusServer],
    per_key: bool,
) -> None:
    key = _setup(mock_backend)
    ModelPrice.objects.create(
        model="llama3:8b", input_per_million=1, output_per_million=2
    )
    env = {"NEXUS_METRICS_PER_KEY": "true"} if per_key else {}
    server = nexus_server_factory(**env)
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    sdk.chat.completions.create(
        model="llama3:8b", messages=[{"role": "user", "content": "spend"}]
    )

    text = httpx.get(f"{server.base_url}/metrics").text

    prefix = key[:11]
    if per_key:
        assert sample(text, "nexus_key_spend_usd_total", key=prefix) > 0
    else:
        # Who reads /metrics does not learn which keys exist or what each spends.
        assert sample(text, "nexus_key_spend_usd_total", key="all") > 0
        assert prefix not in text
