"""The demo fleet shows what Nexus does, through a real gateway and the clients.

The demo's own mocks (``spawn_demo_mock``, as ``nexus_run`` starts them) are
registered as ``nexus_run`` registers them, and Daphne serves Nexus on them.
Structured output, JSON mode, Ollama's ``format``, tools and embeddings are
asked for with the official openai, ollama and anthropic clients.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import ollama
import openai
import pytest
from django.core.management import call_command
from pydantic import BaseModel, Field

from nexus_site.demo import (
    DEMO_BACKENDS,
    DEMO_EMBEDDING_DIM,
    register_demo_backend,
    spawn_demo_mock,
)
from tests.conftest import MockBackendProcess, NexusServer, start_nexus_server
from usage.models import ApiKey

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class Step(BaseModel):
    explanation: str
    output: str


class MathAnswer(BaseModel):
    steps: list[Step]
    final_answer: str
    confidence: float = Field(ge=0, le=1)


class Country(BaseModel):
    name: str
    capital: str
    languages: list[str]
    population: int = Field(gt=0)


@dataclass
class Demo:
    server: NexusServer
    key: str

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.server.base_url}/v1", api_key=self.key, timeout=20
        )

    def ollama(self) -> ollama.Client:
        return ollama.Client(
            host=self.server.base_url,
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=20,
        )


@pytest.fixture(scope="module")
def demo(django_db_setup: None, django_db_blocker: Any) -> Iterator[Demo]:
    mocks: list[MockBackendProcess] = []
    try:
        with django_db_blocker.unblock():
            for spec in DEMO_BACKENDS:
                mock = spawn_demo_mock(spec)
                mocks.append(mock)
                register_demo_backend(spec, mock.base_url)
            _, key = ApiKey.objects.create_key("demo-fleet-tests")
        server = start_nexus_server()
        try:
            yield Demo(server, key)
        finally:
            server.stop()
    finally:
        for mock in mocks:
            mock.stop()
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


def parse_chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    # chat.completions.parse from openai 1.92 on, beta.chat before.
    completions = client.chat.completions
    parse = getattr(completions, "parse", None) or client.beta.chat.completions.parse
    return parse(**kwargs)


def test_parse_returns_the_pydantic_object(demo: Demo) -> None:
    completion = parse_chat(
        demo.openai(),
        model="llama3:8b",
        messages=[{"role": "user", "content": "Solve 8x + 7 = -23"}],
        response_format=MathAnswer,
    )
    answer = completion.choices[0].message.parsed
    assert isinstance(answer, MathAnswer)
    assert answer.steps and answer.final_answer == "Solve 8x + 7 = -23"


def test_json_mode_answers_json_on_every_model_that_declares_it(demo: Demo) -> None:
    client = demo.openai()
    models = {m.name for b in DEMO_BACKENDS for m in b.models if m.json_mode}
    assert models == {"llama3:8b", "mistral:7b", "llava:7b"}
    for model in sorted(models):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "List three colours as JSON"}],
            response_format={"type": "json_object"},
        )
        answer = json.loads(reply.choices[0].message.content or "")
        assert answer["answer"].endswith("echo: List three colours as JSON"), model


def test_responses_text_format_parses(demo: Demo) -> None:
    response = demo.openai().responses.parse(
        model="mistral:7b", input="Tell me about France", text_format=Country
    )
    country = response.output_parsed
    assert isinstance(country, Country)
    assert country.population > 0 and country.languages


def test_ollama_format_schema_validates(demo: Demo) -> None:
    client = demo.ollama()
    # llava:7b only on the Ollama mock (passed through); mistral:7b only on
    # the OpenAI one (translated to response_format).
    for model in ("llava:7b", "mistral:7b"):
        reply = client.chat(
            model=model,
            messages=[{"role": "user", "content": "Tell me about Canada"}],
            format=Country.model_json_schema(),
        )
        assert Country.model_validate_json(reply.message.content or "").name
        plain = client.chat(
            model=model,
            messages=[{"role": "user", "content": "Tell me about Canada"}],
            format="json",
        )
        assert json.loads(plain.message.content or "")["answer"]


def test_every_model_declaring_tools_calls_them(demo: Demo) -> None:
    client = demo.openai()
    models = {m.name for b in DEMO_BACKENDS for m in b.models if m.tools}
    assert models == {"llama3:8b", "mistral:7b"}
    for model in sorted(models):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", model
        call = choice.message.tool_calls[0]  # type: ignore[index]
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        assert json.loads(call.function.arguments) == {  # type: ignore[union-attr]
            "city": "Weather in Paris?"
        }


def test_tools_from_the_anthropic_and_ollama_clients(demo: Demo) -> None:
    message = anthropic.Anthropic(
        base_url=demo.server.base_url, api_key=demo.key, timeout=20
    ).messages.create(
        model="mistral:7b",
        max_tokens=100,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[
            {
                "name": "get_weather",
                "input_schema": WEATHER_TOOL["function"]["parameters"],  # type: ignore[index]
            }
        ],
    )
    assert message.stop_reason == "tool_use"
    reply = demo.ollama().chat(
        model="mistral:7b",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER_TOOL],
    )
    assert reply.message.tool_calls
    assert reply.message.tool_calls[0].function.arguments == {
        "city": "Weather in Oslo?"
    }


def test_the_embedding_model_of_the_readme_is_served(demo: Demo) -> None:
    vectors = demo.ollama().embed(model="nomic-embed-text", input=["one", "two"])
    assert [len(v) for v in vectors.embeddings] == [DEMO_EMBEDDING_DIM] * 2
    reply = demo.openai().embeddings.create(model="nomic-embed-text", input="one")
    assert len(reply.data[0].embedding) == DEMO_EMBEDDING_DIM
